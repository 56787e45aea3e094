"""The serving matrix: every load the project is compared with vLLM at, by the unmodified vLLM client.

`run` drives one OpenAI-compatible server (ouro_fast, or vLLM serving the same shape) through every
workload with vLLM's own `vllm bench serve` code (imported once, called per workload: the client's
start-up is paid once), and saves each result JSON, with the server's mean queue and prefill time over the
workload where its /metrics has vLLM's request phase histograms (both servers do). `report` reads the runs
of several servers and writes the summary table: output tokens/s, TTFT and TPOT, the ratio to the vLLM run
measured on the same machine, each result as a fraction of its floor (bench/floor.py), and where TTFT went.

    # in the client's environment (vLLM 0.33.0 importable), against a running server:
    python -m bench.matrix run --base-url http://127.0.0.1:8000 --model M --tokenizer DIR --label ouro-full \\
        --out bench/results/matrix
    python -m bench.matrix run ... --label ouro-t05 --extra-body '{"exit_threshold": 0.5}'
    python -m bench.matrix report bench/results/matrix --baseline vllm-full --depth ouro-t05=2.4

bench/gpu/matrix.sh runs the whole procedure on the H200, vLLM included (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    prompts: int
    prefix_len: int = 0  # tokens of one prefix shared by every prompt, before its input_len unique ones


WORKLOADS = (
    Workload("c1-128-64", 128, 64, 1, 32),
    Workload("c8-128-64", 128, 64, 8, 64),
    Workload("c32-128-64", 128, 64, 32, 256),
    Workload("c64-128-64", 128, 64, 64, 384),
    Workload("c128-128-64", 128, 64, 128, 512),
    Workload("c8-1024-128", 1024, 128, 8, 48),
    Workload("c32-1024-128", 1024, 128, 32, 128),
    Workload("c8-3800-256", 3800, 256, 8, 24),
)
# Run only when named: a 1,024-token prefix shared by every prompt (prefix caching).
PREFIX_WORKLOADS = (
    Workload("c8-p1024-128-128", 128, 128, 8, 64, prefix_len=1024),
    Workload("c32-p1024-128-128", 128, 128, 32, 256, prefix_len=1024),
)
ALL_WORKLOADS = WORKLOADS + PREFIX_WORKLOADS
KEYS = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "median_itl_ms", "total_output_tokens")  # fmt: skip


def client_args(w: Workload, a: argparse.Namespace, out: Path, warmup: bool = False) -> list[str]:
    """`vllm bench serve` arguments for workload w against the server a.base_url."""
    args = [
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", a.base_url, "--model", a.model,
        "--tokenizer", a.tokenizer, "--dataset-name", "random", "--random-input-len", str(w.input_len),
        "--random-output-len", str(w.output_len), "--ignore-eos", "--temperature", "0",
        "--seed", str(seed(w, a, warmup)), "--request-rate", "inf", "--max-concurrency", str(w.concurrency),
        "--num-prompts", str(min(w.prompts, 2 * w.concurrency) if warmup else w.prompts),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ]  # fmt: skip
    if w.prefix_len:
        args += ["--random-prefix-len", str(w.prefix_len)]
    if a.trust_remote_code:
        args.append("--trust-remote-code")
    if a.extra_body:
        args += ["--extra-body", a.extra_body]
    if not warmup:
        args += ["--save-result", "--result-dir", str(out), "--result-filename", f"{a.label}.{w.name}.json"]
    return args


def seed(w: Workload, a: argparse.Namespace, warmup: bool) -> int:
    """Each workload's own random prompts, and other ones for its warm-up: no measured prompt is cached by
    an earlier run (except a prefix workload's shared prefix, after its first requests)."""
    return a.seed + ALL_WORKLOADS.index(w) + (len(ALL_WORKLOADS) if warmup else 0)


PHASES = ("queue", "prefill")  # vLLM's request phases that TTFT is made of, besides the front end
# ouro_fast's launch counters: how many launches a workload took, and how many carried riders or read a
# shared prefix once for several lanes (absent from vLLM's /metrics).
LAUNCHES = ("run_ahead_steps", "run_ahead_rider_steps", "run_ahead_shared_prefix_steps")
# With the engine's steps: those that were not launches ran on the host path.
COUNTERS = (*LAUNCHES, "engine_steps")


def phase_totals(base_url: str) -> dict[str, float]:
    """{"queue_sum": s, "queue_count": n, ...} of the server's phase histograms, and its COUNTERS where it
    has them ({} without any)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        for phase in PHASES:
            for part in ("sum", "count"):
                name = f"vllm:request_{phase}_time_seconds_{part}"
                if line.startswith((name + "{", name + " ")):  # summed over label sets (vLLM's engines)
                    key = f"{phase}_{part}"
                    totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        for counter in COUNTERS:
            name = f"ouro_fast:{counter}_total"
            if line.startswith((name + "{", name + " ")):
                totals[counter] = totals.get(counter, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def phase_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds of each phase between two phase_totals() scrapes (only phases both have), and the
    COUNTERS' increments."""
    means = {}
    for phase in PHASES:
        n = after.get(f"{phase}_count", 0.0) - before.get(f"{phase}_count", 0.0)
        if n > 0 and f"{phase}_sum" in before:
            means[f"mean_{phase}_ms"] = 1e3 * (after[f"{phase}_sum"] - before[f"{phase}_sum"]) / n
    for counter in COUNTERS:
        if counter in after and counter in before:
            means[counter] = int(round(after[counter] - before[counter]))
    return means


def run(a: argparse.Namespace) -> None:
    # vLLM's own client code, unmodified: its argument parser and main(), called once per workload.
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [w for w in ALL_WORKLOADS if w.name in a.workloads] if a.workloads else list(WORKLOADS)
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    warmed = set()
    for w in chosen:
        # One warm-up per prompt shape: the server's first steps of each shape are not measured.
        if (w.input_len, w.prefix_len) not in warmed:
            serve.main(parser.parse_args(client_args(w, a, out, warmup=True)))
            warmed.add((w.input_len, w.prefix_len))
        t, before = time.perf_counter(), phase_totals(a.base_url)
        result = serve.main(parser.parse_args(client_args(w, a, out)))
        phases = phase_means(before, phase_totals(a.base_url))
        if phases:
            (out / f"{a.label}.{w.name}.phases.json").write_text(json.dumps(phases))
        row = {k: result.get(k) for k in KEYS}
        print(json.dumps({"label": a.label, "workload": w.name, "seconds": round(time.perf_counter() - t, 1),
                          **row, **phases}), flush=True)  # fmt: skip


def _load(folder: Path) -> dict[tuple[str, str], dict]:
    runs = {}
    for f in sorted(folder.glob("*.json")):
        label, _, name = f.stem.partition(".")
        if name in {w.name for w in ALL_WORKLOADS}:
            runs[(label, name)] = json.loads(f.read_text())
            phases = f.with_name(f"{f.stem}.phases.json")
            if phases.exists():
                runs[(label, name)].update(json.loads(phases.read_text()))
    return runs


def report(a: argparse.Namespace) -> None:
    from bench.floor import GPUS, Shape, floor_tok_s

    folder = Path(a.folder)
    runs = _load(folder)
    labels = sorted({label for label, _ in runs}, key=lambda s: (s != a.baseline, s))
    depths = dict(x.split("=") for x in a.depth)
    shape, gpu = Shape(), GPUS[a.gpu]
    lines = [
        f"Machine: {a.machine}. Client: vllm bench serve, random dataset, seed 0, --ignore-eos; ratios "
        f"are to `{a.baseline}` measured in the same run. Floor: bench/floor.py at each label's mean depth "
        "(FP8 weights for labels with -fp8).",
        "",
        "| workload | server | out tok/s | ratio | TTFT p50 | queue / prefill mean | TPOT p50 | TPOT p99 "
        "| of floor | failed | launches: with riders / shared prefix / all | host steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in ALL_WORKLOADS:
        base = runs.get((a.baseline, w.name), {}).get("output_throughput")
        for label in labels:
            r = runs.get((label, w.name))
            if r is None:
                continue
            tput = r.get("output_throughput") or 0.0
            ratio = f"{tput / base:.2f}" if base else "-"
            depth = float(depths.get(label, shape.loops))
            # Labels of FP8 runs (bench/gpu/matrix.sh's QUANTIZATION) take the FP8 weights' floor.
            weights = Shape(fp8=label.endswith("-fp8") or "-fp8-" in label)
            # A shared prefix's floor takes it as computed once: every prompt reads its K/V, none computes it.
            prompt = w.prefix_len + w.input_len
            floor = floor_tok_s(weights, w.concurrency, prompt, w.output_len, depth, gpu, cached=w.prefix_len)
            of_floor = f"{tput / floor:.0%}"
            split = (
                f"{r['mean_queue_ms']:.1f} / {r['mean_prefill_ms']:.1f} ms"
                if "mean_queue_ms" in r and "mean_prefill_ms" in r
                else "-"
            )
            ttft, tpot, p99 = (r.get(k, 0) for k in ("median_ttft_ms", "median_tpot_ms", "p99_tpot_ms"))
            shown = (*LAUNCHES[1:], LAUNCHES[0])  # with riders, with a shared prefix, all
            launches = " / ".join(f"{r[c]:,}" for c in shown) if all(c in r for c in LAUNCHES) else "-"
            host = f"{r['engine_steps'] - r['run_ahead_steps']:,}" if all(c in r for c in COUNTERS) else "-"
            lines.append(
                f"| {w.name} | {label} | {tput:,.0f} | {ratio} | {ttft:.1f} ms | {split} | {tpot:.2f} ms | "
                f"{p99:.2f} ms | {of_floor} | {r.get('failed', '-')} | {launches} | {host} |"
            )
    text = "\n".join(lines) + "\n"
    (folder / "summary.md").write_text(text)
    print(text)


def main() -> None:
    from bench.floor import GPUS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="drive one server through the workloads")
    r.add_argument("--base-url", required=True)
    r.add_argument("--model", required=True, help="the served model name")
    r.add_argument(
        "--tokenizer", required=True, help="tokenizer directory: the same for every server compared"
    )
    r.add_argument("--label", required=True, help="names this server's results, e.g. ouro-full or vllm-full")
    r.add_argument("--extra-body", help="JSON merged into every request, e.g. '{\"exit_threshold\": 0.5}'")
    r.add_argument(
        "--workloads", nargs="*", help="workload names (default: the matrix, without the prefix ones)"
    )
    r.add_argument("--trust-remote-code", action="store_true")
    r.add_argument("--seed", type=int, default=0, help="the first workload's prompt seed (each has its own)")
    r.add_argument("--out", default=f"bench/results/matrix-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    r.set_defaults(func=run)
    s = sub.add_parser("report", help="the summary table of a results folder")
    s.add_argument("folder")
    s.add_argument("--baseline", default="vllm-full", help="the label every ratio is taken against")
    s.add_argument("--depth", nargs="*", default=[], metavar="LABEL=LOOPS", help="mean depth for the floor")
    s.add_argument("--machine", default="one NVIDIA H200")
    s.add_argument(
        "--gpu", choices=sorted(GPUS), default="h200", help="the GPU whose floor each result is a fraction of"
    )
    s.set_defaults(func=report)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
