#!/usr/bin/env bash
# The serving matrix on the H200 against vLLM 0.26.0 serving the same shape on the same machine, in device
# calls that follow each other while the machine stays warm (it keeps /tmp between calls; each call carries
# at most 64 MiB, so the vLLM bundle comes in parts, one or more per call):
#   1. STAGE=part PART=k (with .vllm-bundle/pk carried), for k = 1 .. PARTS: stage the parts that
#      bench/vllm/bundle.sh built; the last one unpacks vLLM into /tmp/vllm-store.
#   2. STAGE=ouro (with .device-wheels): build ouro_fast, serve the ouro-1.4b preset, run every workload
#      of bench/matrix.py at full depth and with exit_threshold 0.5.
#   3. STAGE=vllm: vLLM serves the same shape (dummy weights, its defaults), the same workloads, then the
#      summary (bench/matrix.py report) with every ratio taken against vLLM.
# Every run uses the same client (vLLM 0.33.0's `vllm bench serve` code, from .device-wheels) and ouro_fast's
# tokenizer, so both servers get the same prompts. Raw results stay in /tmp/matrix; $OUT (default
# bench/results/matrix-<time>) gets the summary and a tarball. Settings: WORKLOADS (a subset of
# bench/matrix.py's names), PARTS (2: the number of bundle parts), QUANTIZATION (fp8: both servers quantize
# their weights to FP8 at load, the labels end in -fp8, and the summary's floor column takes FP8 weights
# for them), OURO_ARGS (more `ouro-fast serve` options, e.g. "--max-num-seqs 256"), LABEL (a suffix for
# ouro_fast's labels), DEPTHS (ouro_fast's depths, default "full t05"; empty: none, and vLLM runs no matrix
# workload either), FEATURES=1 (also, at full depth: c=8 with 5 logprobs per token and c=8 and c=32 with a
# JSON schema on every request, ouro_fast only; the prefix workloads of bench/matrix.py on both servers),
# SKIP_SETUP=1 (STAGE=ouro: the wheels and the build of an earlier call on this machine stand).
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
client() {  # vLLM 0.33.0's benchmark client, from the carried wheels: the same code for both servers
  PYTHONPATH=/tmp/site VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    python3 -m bench.matrix run --out "$RES" --tokenizer "$TOKENIZER" ${WORKLOADS:+--workloads $WORKLOADS} "$@"
}
# A JSON schema that every structured request's output must match.
SCHEMA='{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'
features() {  # $1 url, $2 server name: full depth with logprobs, with a JSON schema, with a shared prefix
  local url=$1 name=$2
  shift 2
  if [ "$name" = ouro ]; then
    # Prompts of their own (--seed): the plain runs' prompts would be prefix-cache hits.
    client --base-url "$url" --model ouro --label "ouro-logprobs$SUFFIX" --workloads c8-128-64 \
      --extra-body '{"logprobs": 5}' --seed 100 "$@"
    client --base-url "$url" --model ouro --label "ouro-json$SUFFIX" --workloads c8-128-64 c32-128-64 --seed 200 \
      --extra-body "{\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"a\", \"schema\": $SCHEMA}}}" "$@"
  fi
  client --base-url "$url" --model ouro --label "$name-full$SUFFIX${LABEL:-}" \
    --workloads c8-p1024-128-128 c32-p1024-128-128 "$@"
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
    if [ -z "${SKIP_SETUP:-}" ]; then  # SKIP_SETUP=1: the wheels and the build of an earlier call stand
      eval "$(bash .device-wheels/install.sh)" || exit 3
      python3 -m pip install -q --no-build-isolation --no-deps . || exit 3
    fi
    [ -f "$CKPT/model.safetensors" ] || python3 -P -m ouro_fast.cli make-checkpoint --preset ouro-1.4b --out "$CKPT" --quiet
    # shellcheck disable=SC2086
    (cd /tmp && PYTHONPATH=/tmp/site exec python3 -m ouro_fast.cli serve --model "$CKPT" --served-model-name ouro \
      --port 8000 ${Q:+--quantization $Q} ${OURO_ARGS:-} > "$RES/ouro-server.log" 2>&1) &
    pid=$!
    wait_ready http://127.0.0.1:8000 $pid 300 || { tail -40 "$RES/ouro-server.log"; exit 1; }
    for d in ${DEPTHS-full t05}; do
      body= seed=0
      # Prompts of their own at 0.5: the full-depth run's would be prefix-cache hits.
      [ "$d" = t05 ] && body='{"exit_threshold": 0.5}' seed=500
      client --base-url http://127.0.0.1:8000 --model ouro --label "ouro-$d$SUFFIX${LABEL:-}" --seed $seed \
        ${body:+--extra-body "$body"}
    done
    [ -n "${FEATURES:-}" ] && features http://127.0.0.1:8000 ouro
    kill -INT $pid; wait $pid
    ;;
  vllm)
    [ -d /tmp/site/vllm ] || eval "$(bash .device-wheels/install.sh)" || exit 3  # the client's wheels
    python3 bench/vllm/model_dir.py /tmp/vllm-ouro  # ouro_fast's shipped tokenizer, as the checkpoint holds it
    [ -d "$TOKENIZER" ] || TOKENIZER=/tmp/vllm-ouro  # before any STAGE=ouro: the same files, loaded by vLLM's own config
    export PYTHONPATH="$STORE/site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
      VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0
    python3 -m vllm.entrypoints.cli.main serve /tmp/vllm-ouro --served-model-name ouro --trust-remote-code \
      --load-format dummy --dtype bfloat16 --max-model-len 8192 --gpu-memory-utilization 0.85 --seed 0 \
      --host 127.0.0.1 --port 8011 ${Q:+--quantization $Q} > "$RES/vllm-server.log" 2>&1 &
    pid=$!
    wait_ready http://127.0.0.1:8011 $pid 400 || { tail -60 "$RES/vllm-server.log"; exit 1; }
    [ -n "${DEPTHS-full}" ] && client --base-url http://127.0.0.1:8011 --model ouro --label "vllm-full$SUFFIX" --trust-remote-code
    [ -n "${FEATURES:-}" ] && features http://127.0.0.1:8011 vllm --trust-remote-code
    kill $pid; wait $pid
    # The floor of the GPU this ran on (the machine may be an H100 where an H200 was asked for).
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    case "$name" in *H100*) gpu=h100 ;; *) gpu=h200 ;; esac
    python3 -m bench.matrix report "$RES" --baseline "vllm-full$SUFFIX" --depth "ouro-t05$SUFFIX${LABEL:-}=2.4" \
      --gpu $gpu --machine "one $name"
    cp "$RES/summary.md" "$OUT/"
    ;;
esac
tar czf "$OUT/matrix-results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")" 2> /dev/null
