"""Incremental detokenization per generated token: the compiled core vs its twin.

ouro_fast.engine.detokenizer.IncrementalDetokenizer is driven as the engine
drives it: one `step()` per engine step with one new id for each of B requests
(English text encoded by the shipped tokenizer, so multi-token words and
spaces occur as in real output). Its `core` is either ouro_fast.core.detok or
the twin ouro_fast.core_py.detok; the tokenizer (the `tokenizers` library's
batched decode) is the same for both, and its share is timed separately
through a proxy, so "core" = step - decode_batch (the wrapper's Python code
included); "core_fns" is the time inside the core's plan_windows and
apply_decoded alone.

Variants: no stop strings, and two stop strings that never match (the
holdback and search run on every token).

Run: python -m bench.micro.detok [--quick] [--out bench/results/DIR]
"""

from __future__ import annotations

import gc
import importlib
import os
import time

# As the engine sets it: per-step decode batches are small, tokenizers' thread pool costs more.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.benchlib import bench_main, ratio, summarize
from ouro_fast.engine.detokenizer import IncrementalDetokenizer
from ouro_fast.model.tokenizer import OuroTokenizer

TEXT = (
    "The looped language model runs the same layers several times for each token, and an exit gate "
    "lets easy tokens stop early. Serving many requests at once means batching rows at different "
    "loop depths, refilling the rows that exits free, and keeping every plane of the cache consistent. "
    "Numbers like 3.14159 and 2,718 appear, as do names such as Zürich, naïve and café.\n\n"
)


class TimedDecoder:
    """Forwards to a tokenizers.Tokenizer, adding up the time spent in decode_batch."""

    def __init__(self, raw):
        self.raw = raw
        self.seconds = 0.0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences, skip_special_tokens: bool = True):
        t0 = time.perf_counter()
        out = self.raw.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        self.seconds += time.perf_counter() - t0
        return out

    def get_added_tokens_decoder(self):
        return self.raw.get_added_tokens_decoder()


class TimedCore:
    """The core module with its two per-step functions timed."""

    def __init__(self, core):
        self.DetokState = core.DetokState
        self.REPLACEMENT_CHAR = core.REPLACEMENT_CHAR
        self._core = core
        self.seconds = 0.0

    def plan_windows(self, states):
        t0 = time.perf_counter()
        out = self._core.plan_windows(states)
        self.seconds += time.perf_counter() - t0
        return out

    def apply_decoded(self, states, decoded, final):
        t0 = time.perf_counter()
        out = self._core.apply_decoded(states, decoded, final)
        self.seconds += time.perf_counter() - t0
        return out


def measure(kind: str, batch: int, steps: int, stops: tuple[str, ...]) -> dict:
    tok = OuroTokenizer.default()
    ids = tok.encode(TEXT * 8)
    core = TimedCore(
        importlib.import_module("ouro_fast.core.detok" if kind == "compiled" else "ouro_fast.core_py.detok")
    )
    dec = TimedDecoder(tok.raw)
    det = IncrementalDetokenizer(dec, core=core)
    for k in range(batch):
        det.add(k, ids[k % 50 : k % 50 + 16], True, stops)
    step_us, decode_us, fns_us = [], [], []
    gc.collect()
    for s in range(steps):
        update = {k: [ids[(k * 7 + s) % len(ids)]] for k in range(batch)}
        d0, c0 = dec.seconds, core.seconds
        t0 = time.perf_counter()
        det.step(update)
        step_us.append((time.perf_counter() - t0) * 1e6)
        decode_us.append((dec.seconds - d0) * 1e6)
        fns_us.append((core.seconds - c0) * 1e6)
    core_us = [a - b for a, b in zip(step_us, decode_us)]
    return {
        "impl": kind,
        "batch": batch,
        "stops": len(stops),
        "steps": steps,
        "step_us": summarize(step_us),
        "decode_batch_us": summarize(decode_us),
        "core_us": summarize(core_us),
        "core_fns_us": summarize(fns_us),
        "us_per_token": round(sum(step_us) / (steps * batch), 3),
        "core_us_per_token": round(sum(core_us) / (steps * batch), 3),
        "core_fns_us_per_token": round(sum(fns_us) / (steps * batch), 3),
    }


def run(quick: bool = False) -> list[dict]:
    batches = (1, 8) if quick else (1, 8, 64, 256)
    out = []
    for stops in ((), ("\x00END\x00", "<|stop here|>")):
        for batch in batches:
            steps = 8 if quick else max(50, min(2000, 20_000 // batch))
            c = measure("compiled", batch, steps, stops)
            t = measure("twin", batch, steps, stops)
            c["twin_over_compiled_core"] = ratio(t["core_us"], c["core_us"])
            c["twin_over_compiled_step"] = ratio(t["step_us"], c["step_us"])
            c["twin_over_compiled_core_fns"] = ratio(t["core_fns_us"], c["core_fns_us"])
            out += [c, t]
            print(
                f"stops {len(stops)} batch {batch:4d}: compiled {c['us_per_token']:.2f} us/token "
                f"(core {c['core_us_per_token']:.2f}, fns {c['core_fns_us_per_token']:.2f}), "
                f"twin {t['us_per_token']:.2f} (core {t['core_us_per_token']:.2f}, "
                f"fns {t['core_fns_us_per_token']:.2f}); fns ratio {c['twin_over_compiled_core_fns']:.1f}x",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    return bench_main(__doc__, "detok", run, argv)


if __name__ == "__main__":
    main()
