"""Structured output's host cost per generated token: accepting a token and filling the next bitmask row.

Rows of requests that follow the serving matrix's JSON schema (`bench/gpu/matrix.sh`) with the shipped
tokenizer are driven as the engine drives them: each step every row accepts one token that its mask allows
(a seeded random pick that avoids stop tokens while the grammar is open), then the rows due are filled,
once in one batched call on xgrammar's threads and once one row after another. Also timed: how long the
engine-owner thread is busy when the fill runs on the worker thread (`start_fill` + `wait_fill` after
other work), which is what the owner pays per step when the fill is hidden.

Run: python -m bench.micro.grammar [--quick] [--out bench/results/DIR]
"""

from __future__ import annotations

import random
import time

import numpy as np

from bench.benchlib import bench_main, summarize
from ouro_fast.engine.structured import Grammars, StructuredOutput
from ouro_fast.model.tokenizer import OuroTokenizer

SCHEMA = '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'
VOCAB = 49152  # Ouro-1.4B's logits; ids beyond the tokenizer's are never allowed


def allowed(g: Grammars, rid: int, n: int) -> list[int]:
    words = g.bitmask[rid].numpy().view(np.uint32)[: (n + 31) // 32]
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:n]
    return np.flatnonzero(bits).tolist()


def measure(rows: int, steps: int, mode: str) -> dict:
    """mode: batched (fill_pending, one call), single (each row's own fill), async (start_fill, then the
    owner's other work, then wait_fill: only the owner's time counts)."""
    tok = OuroTokenizer.default()
    n = tok.raw.get_vocab_size()
    stops = {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")} - {None}
    g = Grammars.for_tokenizer(tok, VOCAB, stops, rows, "cpu")
    want = StructuredOutput("json", SCHEMA)
    rng = random.Random(0)
    for r in range(rows):
        g.add(r, want)
    g.fill_pending()
    accept_us, fill_us, owner_us = [], [], []
    for _ in range(steps):
        spent = 0.0
        for r in range(rows):
            choices = [t for t in allowed(g, r, n) if t not in stops] or allowed(g, r, n)
            t1 = time.perf_counter()
            g.accept(r, rng.choice(choices))
            spent += time.perf_counter() - t1
        accept_us.append(spent * 1e6 / rows)
        t2 = time.perf_counter()
        if mode == "single":
            for r in sorted(g.stale):
                g.matchers[r].fill_next_token_bitmask(g.bitmask, r)
            g.stale.clear()
        elif mode == "batched":
            g.fill_pending()
        else:
            g.start_fill()
            t3 = time.perf_counter()
            time.sleep(0.002)  # the owner's other work: the device step, replay, detokenization
            t4 = time.perf_counter()
            g.wait_fill()
            owner_us.append(((t3 - t2) + (time.perf_counter() - t4)) * 1e6 / rows)
        fill_us.append((time.perf_counter() - t2) * 1e6 / rows)
        for r in range(rows):
            if g.complete(r):  # the object closed: a fresh request takes the row
                g.remove(r)
                g.add(r, want)
        g.fill_pending()
    out = {"rows": rows, "mode": mode, "steps": steps, "accept_us_per_token": summarize(accept_us)}
    if mode == "async":
        out["owner_us_per_token"] = summarize(owner_us)
    else:
        out["fill_us_per_token"] = summarize(fill_us)
    return out


def run(quick: bool = False) -> list[dict]:
    out = []
    for rows in (1, 8) if quick else (1, 8, 32, 128):
        steps = 4 if quick else 40
        got = {mode: measure(rows, steps, mode) for mode in ("single", "batched", "async")}
        out += got.values()
        print(
            f"rows {rows:4d}: accept {got['batched']['accept_us_per_token']['p50']:.1f} us/token; fill "
            f"{got['single']['fill_us_per_token']['p50']:.1f} one by one, "
            f"{got['batched']['fill_us_per_token']['p50']:.1f} batched; the owner's share on the worker "
            f"{got['async']['owner_us_per_token']['p50']:.1f}",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    return bench_main(__doc__, "grammar", run, argv)


if __name__ == "__main__":
    main()
