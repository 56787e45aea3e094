"""Turn a results folder's JSON files into summary.md (the tables docs/benchmarks.md quotes).

Reads whichever of scheduler.json, vllm_scheduler.json, block_table.json,
detok.json, ring.json and engine.json exist in the folder.

Run: python -m bench.summarize bench/results/DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.benchlib import fmt_us

TARGETS_US = {8: 20.0, 256: 100.0}


def md_row(*cells: object) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def header(doc: dict, name: str) -> str:
    m = doc["machine"]
    return (
        f"`{name}.json`: {m['cpu']}, {m['cores']} cores, load average {m['loadavg']} before / "
        f"{doc['loadavg_after']} after; commit `{doc['commit']}`; `{doc['command']}`"
    )


def pick(rows: list[dict], **want) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def scheduler_table(sched: dict, vllm: dict | None, policy: str) -> list[str]:
    rows = sched["results"]
    v_rows = vllm["results"] if vllm else []
    out = [
        f"Depth policy `{policy}`, no waiting requests. Per step: median [p10-p90] microseconds of "
        "schedule() + update(). Per batch-token: the scheduler time to advance every row by one token, "
        "median step x steps per token (ours: the mean depth, 4 at full depth; vLLM: one step); per "
        "token = per batch-token / batch. Ratios are of medians.",
        "",
        md_row(
            "batch",
            "compiled µs/step",
            "twin µs/step",
            "twin/compiled",
            "vLLM 0.33 µs/step",
            "vLLM/compiled (step)",
            "compiled µs/batch-token",
            "vLLM µs/batch-token",
            "vLLM/compiled (token)",
            "compiled µs/token",
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch in sorted({r["batch"] for r in rows}):
        c = pick(rows, impl="compiled", batch=batch, waiting=0, policy=policy)
        t = pick(rows, impl="twin", batch=batch, waiting=0, policy=policy)
        v = pick(v_rows, batch=batch, waiting=0, prefix_caching=True)
        if not c or not t:
            continue
        vs = fmt_us(v["step_us"]) if v else "-"
        v_step = f"{v['step_us']['p50'] / c['step_us']['p50']:.1f}x" if v else "-"
        v_tok = f"{v['us_per_batch_token']:,.1f}" if v else "-"
        v_ratio = f"{v['us_per_batch_token'] / c['us_per_batch_token']:.1f}x" if v else "-"
        out.append(
            md_row(
                batch,
                fmt_us(c["step_us"]),
                fmt_us(t["step_us"]),
                f"{c['twin_over_compiled']:.1f}x",
                vs,
                v_step,
                f"{c['us_per_batch_token']:,.1f}",
                v_tok,
                v_ratio,
                f"{c['us_per_token']:.2f}",
            )
        )
    return out


def candidate_table(sched: dict) -> list[str]:
    """The rows measured with --candidate (a patched LoopScheduler), next to the compiled and twin."""
    rows = sched["results"]
    cands = [r for r in rows if r["impl"].startswith("candidate:")]
    if not cands:
        return []
    out = [
        f"Candidate `{cands[0]['impl'].split(':', 1)[1]}` (a patched LoopScheduler over the compiled "
        "BlockTable), no waiting requests. Median [p10-p90] µs per step.",
        "",
        md_row(
            "policy",
            "batch",
            "compiled",
            "candidate",
            "twin",
            "compiled/candidate",
            "twin/candidate",
            "candidate µs/token",
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in cands:
        c = pick(rows, impl="compiled", batch=r["batch"], waiting=0, policy=r["policy"])
        t = pick(rows, impl="twin", batch=r["batch"], waiting=0, policy=r["policy"])
        out.append(
            md_row(
                r["policy"],
                r["batch"],
                fmt_us(c["step_us"]),
                fmt_us(r["step_us"]),
                fmt_us(t["step_us"]),
                f"{r['compiled_over_candidate']:.1f}x",
                f"{r['twin_over_candidate']:.1f}x",
                f"{r['us_per_token']:.3f}",
            )
        )
    return out


def waiting_table(sched: dict, vllm: dict | None) -> list[str]:
    rows = sched["results"]
    v_rows = vllm["results"] if vllm else []
    waits = sorted({r["waiting"] for r in rows})
    out = [
        "Median µs per step by waiting-queue length (depth policy `full`).",
        "",
        "| impl | batch | " + " | ".join(f"{w} waiting" for w in waits) + " |",
        "|---|---|" + "---|" * len(waits),
    ]
    for impl in ("compiled", "twin", "vllm-0.33.0"):
        for batch in sorted({r["batch"] for r in rows}):
            cells = []
            for w in waits:
                if impl == "vllm-0.33.0":
                    r = pick(v_rows, batch=batch, waiting=w, prefix_caching=True)
                else:
                    r = pick(rows, impl=impl, batch=batch, waiting=w, policy="full")
                cells.append(f"{r['step_us']['p50']:,.2f}" if r else "-")
            if any(c != "-" for c in cells):
                out.append(f"| {impl} | {batch} | " + " | ".join(cells) + " |")
    return out


def targets(sched: dict, vllm: dict | None) -> list[str]:
    rows = sched["results"]
    v_rows = vllm["results"] if vllm else []
    out = [md_row("target", "measured", "met"), "|---|---|---|"]
    for batch, limit in TARGETS_US.items():
        c = pick(rows, impl="compiled", batch=batch, waiting=0, policy="full")
        if c:
            p50 = c["step_us"]["p50"]
            out.append(
                md_row(f"compiled step < {limit:g} µs at batch {batch}", f"{p50:,.1f} µs", yes(p50 < limit))
            )
    ours = [r for r in rows if r["impl"] == "compiled" and r["waiting"] == 0 and r["policy"] == "full"]
    for r in ours:
        k = r["twin_over_compiled"]
        out.append(md_row(f">= 10x faster than the twin, batch {r['batch']}", f"{k:.1f}x", yes(k >= 10)))
    for r in ours:
        v = pick(v_rows, batch=r["batch"], waiting=0, prefix_caching=True)
        if v:
            step = f"{r['step_us']['p50']:,.1f} vs {v['step_us']['p50']:,.1f} µs"
            tok = f"{r['us_per_batch_token']:,.1f} vs {v['us_per_batch_token']:,.1f} µs"
            met = f"{yes(r['step_us']['p50'] < v['step_us']['p50'])} / "
            met += yes(r["us_per_batch_token"] < v["us_per_batch_token"])
            out.append(
                md_row(
                    f"faster than vLLM, batch {r['batch']} (per step / per batch-token)",
                    f"{step} / {tok}",
                    met,
                )
            )
    return out


def block_table_table(doc: dict) -> list[str]:
    out = [md_row("operation", "compiled µs/call", "twin µs/call", "twin/compiled"), "|---|---|---|---|"]
    for r in doc["results"]:
        k = f"{r['twin_over_compiled']:.1f}x"
        out.append(md_row(r["op"], fmt_us(r["compiled_us"]), fmt_us(r["twin_us"]), k))
    return out


def detok_table(doc: dict) -> list[str]:
    out = [
        "µs per generated token (one step with one token per request, divided by the batch). "
        "`core fns` = time inside plan_windows + apply_decoded; `step` includes the wrapper and "
        "the tokenizers library's decode_batch (the same for both).",
        "",
        md_row(
            "stop strings",
            "batch",
            "compiled step",
            "twin step",
            "compiled core fns",
            "twin core fns",
            "twin/compiled (fns)",
        ),
        "|---|---|---|---|---|---|---|",
    ]
    rows = doc["results"]
    for c in rows:
        if c["impl"] != "compiled":
            continue
        t = pick(rows, impl="twin", batch=c["batch"], stops=c["stops"])
        out.append(
            md_row(
                c["stops"],
                c["batch"],
                f"{c['us_per_token']:.2f}",
                f"{t['us_per_token']:.2f}",
                f"{c['core_fns_us_per_token']:.2f}",
                f"{t['core_fns_us_per_token']:.2f}",
                f"{c['twin_over_compiled_core_fns']:.1f}x",
            )
        )
    return out


def ring_table(doc: dict) -> list[str]:
    r = doc["results"]
    out = [md_row("measure", "compiled", "twin", "twin/compiled"), "|---|---|---|---|"]
    c, t, k = r["compiled"], r["twin"], r["twin_over_compiled"]
    per = "pop_many_64_us_per_record"
    thr_c, thr_t = c["two_threads"]["records_per_s"], t["two_threads"]["records_per_s"]
    out.append(
        md_row(
            "push+pop, one thread (µs)",
            fmt_us(c["push_pop_us"]),
            fmt_us(t["push_pop_us"]),
            f"{k['push_pop']:.1f}x",
        )
    )
    out.append(
        md_row(
            "64 pushes + pop_many(64), per record (µs)",
            fmt_us(c[per]),
            fmt_us(t[per]),
            f"{k['pop_many_64']:.1f}x",
        )
    )
    out.append(
        md_row("two threads, records/s", f"{thr_c:,}", f"{thr_t:,}", f"{k['two_threads_throughput']:.1f}x")
    )
    out.append(md_row("ping-pong round trip (µs)", fmt_us(c["ping_pong_us"]), fmt_us(t["ping_pong_us"]), "-"))
    return out


def engine_table(doc: dict) -> list[str]:
    out = [
        f"Preset `{doc['preset']}`, {doc['device']}, {doc['dtype']}, gate bias {doc['gate_bias']}, "
        f"{doc['results'][0]['requests']} requests of {doc['results'][0]['input_len']} in / "
        f"{doc['results'][0]['output_len']} out, max_num_seqs {doc.get('max_num_seqs', '?')}, "
        f"torch {doc['torch']} with {doc['torch_threads']} thread(s). ms per step: total [scheduler / model "
        "(sampling inside it) / detokenization].",
        "",
        md_row(
            "exit_threshold",
            "refill",
            "tok/s",
            "steps",
            "ms/step: total [sched / model (sampling) / detok]",
            "mean depth",
            "depth histogram 1/2/3/4",
            "KV peak / pool",
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        s = r["ms_per_step"]
        split = f"{s['scheduler']:.3f} / {s['model']:.2f} ({s['sampling_in_model']:.3f}) / {s['detok']:.3f}"
        kv = f"{r['kv_peak_blocks']:,} / {r['kv_total_blocks']:,} ({100 * r['kv_utilisation']:.1f}%)"
        out.append(
            md_row(
                f"{r['exit_threshold']:g}",
                "on" if r["refill"] else "off",
                f"{r['output_tokens_per_s']:,.0f}",
                r["steps"],
                f"{s['total']:.2f} [{split}]",
                f"{r['mean_depth']:.2f}",
                "/".join(str(v) for v in r["depth_histogram"].values()),
                kv,
            )
        )
    return out


def summarize(folder: Path) -> str:
    parts = [f"# Benchmark summary: {folder.name}", ""]
    sched, vllm = load(folder, "scheduler"), load(folder, "vllm_scheduler")
    if sched:
        parts += ["## Loop scheduler vs vLLM 0.33.0's v1 scheduler", ""]
        for policy in ("full", "mixed"):
            if pick(sched["results"], policy=policy):
                parts += scheduler_table(sched, vllm, policy) + [""]
        parts += waiting_table(sched, vllm) + ["", "### Targets", ""] + targets(sched, vllm) + [""]
        cand = candidate_table(sched)
        if cand:
            parts += ["### Proposed fast path (candidate)", ""] + cand + [""]
    sections = (
        ("block_table", "Block tables", block_table_table),
        ("detok", "Detokenization offsets", detok_table),
        ("ring", "Request ring", ring_table),
        ("engine", "Engine (offline, no HTTP)", engine_table),
        ("engine_queue", "Engine with a queue (more requests than rows)", engine_table),
    )
    for name, title, fn in sections:
        doc = load(folder, name)
        if doc:
            parts += [f"## {title}", ""] + fn(doc) + [""]
    parts += ["## Provenance", ""]
    for name in ("scheduler", "vllm_scheduler", "block_table", "detok", "ring", "engine", "engine_queue"):
        doc = load(folder, name)
        if doc:
            parts.append(f"- {header(doc, name)}")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", help="a results folder (bench/results/NAME)")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    text = summarize(folder)
    (folder / "summary.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
