"""AIPerf and `vllm bench serve` on the same workload: one table from their result folders.

Pairs an AIPerf run (bench/aiperf/run.py: manifest.json, <scenario>/profile_export.jsonl) with a
serve_bench run (bench/serve_bench.py: manifest.json, results/<run>.json) by concurrency, and puts
each figure beside its counterpart: output tokens/s, requests/s, TTFT, TPOT (AIPerf calls it inter
token latency), per-chunk gaps (vLLM's ITL, AIPerf's inter-chunk latency), end-to-end latency, and
from AIPerf's records the time to the first byte of the response (http_req_waiting) and how many
chunks carried text per generated token. Medians are over requests (per chunk for the gaps).

  python -m bench.aiperf.compare --aiperf DIR --vllm DIR [--aiperf DIR --vllm DIR ...] > compare.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.benchlib import percentile


def _stats(values: list[float]) -> dict:
    s = sorted(values)
    if not s:
        return {}
    return {"mean": statistics.fmean(s), "median": percentile(s, 0.5), "p99": percentile(s, 0.99)}


def aiperf_rows(folder: Path) -> dict[int, dict]:
    """{concurrency: figures} of an AIPerf run folder, from its manifest and per-request records."""
    manifest = json.loads((folder / "manifest.json").read_text())
    rows = {}
    for sc in manifest["scenarios"]:
        summary = json.loads((folder / sc["scenario"] / "profile_export_aiperf.json").read_text())
        conc = summary["input_config"]["phases"][-1]["concurrency"]
        recs = [json.loads(line) for line in (folder / sc["scenario"] / "profile_export.jsonl").open()]
        recs = [r for r in recs if r["metadata"]["benchmark_phase"] == "profiling"]
        m = [r["metrics"] for r in recs]
        texts = sum(len(x["inter_chunk_latency"]["value"]) + 1 for x in m)
        tokens = sum(x["usage_completion_tokens"]["value"] for x in m)
        rows[conc] = {
            "tool": f"AIPerf ({sc['scenario']})", "requests": len(recs),
            "output_tps": summary["output_token_throughput"]["avg"],
            "req_s": summary["request_throughput"]["avg"],
            "ttft": _stats([x["time_to_first_token"]["value"] for x in m]),
            "ttfb": _stats([x["http_req_waiting"]["value"] for x in m]),
            "tpot": _stats([x["inter_token_latency"]["value"] for x in m]),
            "gap": _stats([g for x in m for g in x["inter_chunk_latency"]["value"]]),
            "e2e": _stats([x["request_latency"]["value"] for x in m]),
            "prompt_tokens": sum(x["usage_prompt_tokens"]["value"] for x in m),
            "text_chunks_per_token": texts / tokens if tokens else None,
        }  # fmt: skip
    return rows


def vllm_rows(folder: Path) -> dict[int, dict]:
    """{concurrency: figures} of a serve_bench run folder (its concurrency runs only)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    rows = {}
    for run in manifest["runs"]:
        if run["concurrency"] is None:
            continue
        r = json.loads((folder / run["result_file"]).read_text())
        tpots = [(e - t) / (n - 1) for e, t, n in zip(r["latencies"], r["ttfts"], r["output_lens"]) if n > 1]
        rows[run["concurrency"]] = {
            "tool": f"vllm bench serve ({run['label']})", "requests": r["completed"],
            "output_tps": r["output_throughput"], "req_s": r["request_throughput"],
            "ttft": _stats([t * 1e3 for t in r["ttfts"]]), "ttfb": {},
            "tpot": _stats([t * 1e3 for t in tpots]),
            "gap": _stats([g * 1e3 for x in r["itls"] for g in x]),
            "e2e": _stats([e * 1e3 for e in r["latencies"]]),
            "prompt_tokens": r["total_input_tokens"],
            "text_chunks_per_token": (sum(len(x) + 1 for x in r["itls"]) / sum(r["output_lens"])),
        }  # fmt: skip
    return rows


def _ms(st: dict, key: str) -> str:
    return f"{st[key]:.2f}" if st else "-"


def table(pairs: list[tuple[Path, Path]]) -> str:
    """Markdown: one row per tool, run and concurrency (vLLM's chunk count is of chunks with choices)."""
    lines = [
        "| concurrency | tool | run | requests | output tok/s | req/s | TTFT median / p99 (ms) | "
        "first byte median (ms) | TPOT median / p99 (ms) | chunk gap median / p99 (ms) | E2E median (ms) | "
        "prompt tokens | chunks per token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for i, (a, v) in enumerate(pairs, 1):
        for conc, row in sorted(aiperf_rows(a).items()):
            rows.append((conc, 0, i, row))
        for conc, row in sorted(vllm_rows(v).items()):
            rows.append((conc, 1, i, row))
    for conc, _, i, r in sorted(rows, key=lambda x: (x[0], x[1], x[2])):
        cells = [
            conc, r["tool"], i, r["requests"], f"{r['output_tps']:.1f}", f"{r['req_s']:.2f}",
            f"{_ms(r['ttft'], 'median')} / {_ms(r['ttft'], 'p99')}", _ms(r["ttfb"], "median"),
            f"{_ms(r['tpot'], 'median')} / {_ms(r['tpot'], 'p99')}",
            f"{_ms(r['gap'], 'median')} / {_ms(r['gap'], 'p99')}", _ms(r["e2e"], "median"),
            r["prompt_tokens"], f"{r['text_chunks_per_token']:.3f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.aiperf.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--aiperf", action="append", required=True, type=Path, help="an AIPerf run folder")
    p.add_argument("--vllm", action="append", required=True, type=Path, help="a serve_bench run folder")
    args = p.parse_args(argv)
    if len(args.aiperf) != len(args.vllm):
        raise SystemExit("give --aiperf and --vllm in pairs")
    sys.stdout.write(table(list(zip(args.aiperf, args.vllm))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
