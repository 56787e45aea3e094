#!/usr/bin/env bash
# Run every CPU benchmark into bench/results/NAME (git-ignored) and write its summary.md
# (about two minutes on 2 cores). Check `uptime` first: the numbers are only as quiet as the machine.
#   bash bench/run_cpu.sh [NAME]
# PYTHON: the project's interpreter (default python3); the vLLM scheduler runs in the client venv
# (bench/setup_vllm_client.sh builds it on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:-cpu-$(date -u +%Y%m%d-%H%M)}
OUT=bench/results/$NAME
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/commands.txt"
run() { echo "$*" >> "$OUT/commands.txt"; echo "+ $*" >&2; "$@"; }
CLIENT=$(bash bench/setup_vllm_client.sh 2>/dev/null | tail -1)
echo "start: $(uptime)" > "$OUT/uptime.txt"
run "$PY" -m bench.micro.scheduler --out "$OUT"
run "$CLIENT/bin/python" -m bench.vllm_scheduler_bench --out "$OUT"
run "$PY" -m bench.micro.block_table --out "$OUT"
run "$PY" -m bench.micro.detok --out "$OUT"
run "$PY" -m bench.micro.ring --out "$OUT"
run "$PY" -m bench.micro.profile_scheduler --batch 256 --out "$OUT/scheduler_profile_twin.txt" > /dev/null
if command -v perf > /dev/null; then
  # Where the compiled core's step goes, by C symbol and grouped by cause (batch 256, steady decode).
  tmp=$(mktemp -d)
  run perf record -q -e cpu-clock -F 4000 -o "$tmp/perf.data" -- "$PY" -m bench.micro.profile_scheduler --mode loop --batch 256 --seconds 5 > /dev/null
  perf report -i "$tmp/perf.data" --no-children --sort dso,symbol 2> /dev/null > "$tmp/report.txt"
  grep -E '^ +[0-9]' "$tmp/report.txt" > "$tmp/top.txt" || true
  head -n 40 "$tmp/top.txt" > "$OUT/scheduler_perf_compiled.txt"
  run "$PY" -m bench.micro.profile_scheduler --mode group --perf-report "$tmp/report.txt" --out "$OUT/scheduler_perf_grouped.txt" > /dev/null
  rm -rf "$tmp"
fi
run "$PY" -m bench.engine_bench --out "$OUT"
# More requests than rows: here refill has waiting requests to start when exits free rows.
run "$PY" -m bench.engine_bench --out "$OUT" --name engine_queue --num-requests 128 --max-num-seqs 32 --thresholds 1.0,0.5
echo "end: $(uptime)" >> "$OUT/uptime.txt"
run "$PY" -m bench.summarize "$OUT" > /dev/null
echo "$OUT/summary.md"
