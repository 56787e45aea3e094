#!/usr/bin/env bash
# The serving matrix on the H200 against vLLM 0.26.0 serving the same shape on the same machine, in device
# calls that follow each other while the machine stays warm (it keeps /tmp between calls):
#   1. STAGE=part PART=1 (with .vllm-bundle/p1 copied there), then STAGE=part PART=2 (with .vllm-bundle/p2):
#      stage the parts that bench/vllm/bundle.sh built; the last part unpacks vLLM into /tmp/vllm-store.
#   2. STAGE=ouro (with .device-wheels): build ouro_fast, serve the ouro-1.4b preset, run every workload
#      of bench/matrix.py at full depth and with exit_threshold 0.5.
#   3. STAGE=vllm: vLLM serves the same shape (dummy weights, its defaults), the same workloads, then the
#      summary (bench/matrix.py report) with every ratio taken against vLLM.
# Every run uses vLLM 0.26.0's own `vllm bench serve` code and ouro_fast's tokenizer, so both servers get the
# same prompts. Raw results stay in /tmp/matrix; $OUT (default bench/results/matrix-<time>) gets the summary
# and a tarball. Settings: WORKLOADS (a subset of bench/matrix.py's names), PARTS (2), QUANTIZATION (fp8:
# both servers quantize their weights to FP8 at load, the labels end in -fp8, and the summary's floor
# column still assumes bf16 weights), OURO_ARGS (more
# `ouro-fast serve` options, e.g. "--max-num-seqs 256"), LABEL (a suffix for ouro_fast's labels).
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-bench/results/matrix-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/matrix.log") 2>&1
STORE=/tmp/vllm-store
RES=/tmp/matrix
CKPT=/tmp/matrix-ckpt
TOKENIZER=${TOKENIZER:-$CKPT/tokenizer}  # ouro_fast's tokenizer, as the client loads it
Q=${QUANTIZATION:-}
SUFFIX=${Q:+-$Q}
mkdir -p "$STORE" "$RES"
client() {  # the bundle's vLLM client, beside the server wheels
  PYTHONPATH="$STORE/site:/tmp/site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    python3 -m bench.matrix run --out "$RES" --tokenizer "$TOKENIZER" ${WORKLOADS:+--workloads $WORKLOADS} "$@"
}
wait_ready() {  # $1 url, $2 pid, $3 seconds
  for _ in $(seq "$3"); do
    curl -sf "$1/health" > /dev/null && return 0
    kill -0 "$2" 2> /dev/null || return 1
    sleep 1
  done
  return 1
}
case "${STAGE:?STAGE=part, ouro or vllm}" in
  part)
    cp .vllm-bundle/p"${PART:?}"/* "$STORE/"
    if [ "$(ls "$STORE"/part.* | wc -l)" -ge "${PARTS:-2}" ]; then
      (cd "$STORE" && cat part.* > site.tar.xz && sha256sum -c SHA256SUMS && tar xJf site.tar.xz && rm -f part.* site.tar.xz)
      du -sh "$STORE/site"
    fi
    ;;
  ouro)
    eval "$(bash .device-wheels/install.sh)" || exit 3
    python3 -m pip install -q --no-build-isolation --no-deps . || exit 3
    [ -f "$CKPT/model.safetensors" ] || python3 -P -m ouro_fast.cli make-checkpoint --preset ouro-1.4b --out "$CKPT" --quiet
    # shellcheck disable=SC2086
    (cd /tmp && PYTHONPATH=/tmp/site exec python3 -m ouro_fast.cli serve --model "$CKPT" --served-model-name ouro \
      --port 8000 ${Q:+--quantization $Q} ${OURO_ARGS:-} > "$RES/ouro-server.log" 2>&1) &
    pid=$!
    wait_ready http://127.0.0.1:8000 $pid 300 || { tail -40 "$RES/ouro-server.log"; exit 1; }
    client --base-url http://127.0.0.1:8000 --model ouro --label "ouro-full$SUFFIX${LABEL:-}"
    client --base-url http://127.0.0.1:8000 --model ouro --label "ouro-t05$SUFFIX${LABEL:-}" \
      --extra-body '{"exit_threshold": 0.5}'
    kill -INT $pid; wait $pid
    ;;
  vllm)
    python3 bench/vllm/model_dir.py /tmp/vllm-ouro  # ouro_fast's shipped tokenizer, as the checkpoint holds it
    [ -d "$TOKENIZER" ] || TOKENIZER=/tmp/vllm-ouro  # before any STAGE=ouro: the same files, loaded by vLLM's own config
    export PYTHONPATH="$STORE/site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
      VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0
    python3 -m vllm.entrypoints.cli.main serve /tmp/vllm-ouro --served-model-name ouro --trust-remote-code \
      --load-format dummy --dtype bfloat16 --max-model-len 8192 --gpu-memory-utilization 0.85 --seed 0 \
      --host 127.0.0.1 --port 8011 ${Q:+--quantization $Q} > "$RES/vllm-server.log" 2>&1 &
    pid=$!
    wait_ready http://127.0.0.1:8011 $pid 400 || { tail -60 "$RES/vllm-server.log"; exit 1; }
    client --base-url http://127.0.0.1:8011 --model ouro --label "vllm-full$SUFFIX" --trust-remote-code
    kill $pid; wait $pid
    python3 -m bench.matrix report "$RES" --baseline "vllm-full$SUFFIX" --depth "ouro-t05$SUFFIX${LABEL:-}=2.4"
    cp "$RES/summary.md" "$OUT/"
    ;;
esac
tar czf "$OUT/matrix-results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")" 2> /dev/null
