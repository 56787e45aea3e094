"""Where a decode layer's attention hop goes: global-timer stamps inside the captured loop (GPU only).

step_bench.py's captured run_loop_fused (ouro-1.4b, random bf16, context ~`--context`), with stamps on every
layer's qkv and o_proj (tc_linear's: start, PDL wait over, first tile, done), fused decode attention (start,
early loads issued, wait over, slice attended, arrival counted, merged) and the add + RMSNorm after o_proj
(start, wait over, done). The wrappers below pass the stamp buffers in; the loop's code is unchanged. Prints
one JSON line per row count: per-layer medians in microseconds, each event against the end of the kernel
before it (its last CTA's "done"), and the same for the last replay's programs (min / median / max across
programs where it matters).

    python3 -P bench/gpu/attn_timeline.py --rows 1 2 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from ouro_fast.kernels import tc_gemm
from ouro_fast.model import fast_loop, triton_attention
from ouro_fast.model.fast_loop import run_loop_fused
from ouro_fast.model.triton_attention import TritonPagedAttention

sys.path.insert(0, str(Path(__file__).parent))  # step_bench, replay_timing, next to this file
from replay_timing import capture, replay_ms  # noqa: E402
from step_bench import build, decode_batch  # noqa: E402


class Stamps:
    """Per-layer stamp buffers, handed out in call order (mod layers: the eager run before capture, then the
    captured one, write the same buffers)."""

    def __init__(self, layers: int, rows: int, programs: int, ctas: int, device: str = "cuda"):
        z = lambda *s: torch.zeros(*s, device=device, dtype=torch.int64)  # noqa: E731
        self.qkv, self.o = z(layers, ctas, 4), z(layers, ctas, 4)
        self.attn, self.norm = z(layers, programs, 8), z(layers, rows, 4)
        self.layers = layers
        self.calls = {k: itertools.count() for k in ("qkv", "o", "attn", "norm")}

    def next(self, kind: str) -> torch.Tensor:
        return getattr(self, kind)[next(self.calls[kind]) % self.layers]


def patch(st: Stamps, hidden: int):
    """Wrap tc_linear (qkv, o_proj), fused_decode_attention and the loop's add_rms_norm (the one after o_proj,
    every other call) to pass stamps; returns a function that restores them."""
    tc_linear, attn_fn, norm_fn = (
        tc_gemm.tc_linear,
        triton_attention.fused_decode_attention,
        fast_loop.add_rms_norm,
    )
    norms = itertools.count()

    def linear(x, w, *args, **kw):
        kind = {3 * hidden: "qkv", hidden: "o"}.get(w.shape[0]) if w.shape[1] == hidden else None
        if kind and not kw.get("swiglu_out"):
            kw["stamps"] = st.next(kind)
        return tc_linear(x, w, *args, **kw)

    def attention(*args, **kw):
        return attn_fn(*args, **kw, stamps=st.next("attn"))

    def norm(h, a, *args, **kw):
        if next(norms) % 2 == 0:  # the first of a layer's two: after o_proj
            kw["stamps"] = st.next("norm")
        return norm_fn(h, a, *args, **kw)

    tc_gemm.tc_linear, triton_attention.fused_decode_attention, fast_loop.add_rms_norm = (
        linear,
        attention,
        norm,
    )

    def restore():
        tc_gemm.tc_linear, fast_loop.add_rms_norm = tc_linear, norm_fn
        triton_attention.fused_decode_attention = attn_fn

    return restore


def _us(t: torch.Tensor, base: int) -> torch.Tensor:
    # Microseconds after `base` (0 stays 0: no stamp). Subtracted in int64 first: the global timer counts ns
    # from ~1.7e18, where a double's spacing is 256 ns.
    return torch.where(t > 0, (t - base).double() / 1e3, 0.0)


def summarize(st: Stamps) -> dict:
    """Per-layer medians (us) of each event against the end of the kernel before it."""
    bufs = (st.qkv, st.o, st.attn, st.norm)
    base = min(int(b[b > 0].min()) for b in bufs if bool((b > 0).any())) - 1
    q, o, a, n = (_us(b, base) for b in bufs)
    inf = float("inf")

    def first(t, k):  # earliest stamp k of each layer's CTAs / programs that stamped it
        return torch.where(t[..., k] > 0, t[..., k], inf).min(1).values

    def last(t, k):
        return torch.where(t[..., k] > 0, t[..., k], -inf).max(1).values

    def med(t, k):  # median over the programs that stamped event k
        return torch.stack(
            [row[row > 0].median() if bool((row > 0).any()) else row[0] * 0 + inf for row in t[..., k]]
        )

    q_done, a_end, o_done = last(q, 3), torch.maximum(last(a, 4), last(a, 5)), last(o, 3)
    rows = {
        "attn_first_start": first(a, 0) - q_done,
        "attn_first_wait_over": first(a, 2) - q_done,
        "attn_median_wait_over": med(a, 2) - q_done,
        "attn_last_wait_over": last(a, 2) - q_done,
        "attn_median_attended": med(a, 3) - q_done,
        "attn_last_attended": last(a, 3) - q_done,
        "attn_median_counted": med(a, 4) - q_done,
        "attn_last_counted": last(a, 4) - q_done,
        "attn_first_merged": first(a, 5) - q_done,
        "attn_last_merged": last(a, 5) - q_done,
        "o_first_start_after_attn": first(o, 0) - a_end,
        "o_first_wait_over_after_attn": first(o, 1) - a_end,
        "o_last_done_after_attn": o_done - a_end,
        "norm_first_wait_over_after_o": first(n, 1) - o_done,
        "norm_last_done_after_o": last(n, 2) - o_done,
        "qkv_last_done_after_qkv_first_wait_over": q_done - first(q, 1),
    }
    return {k: round(float(v.median()), 3) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    model = build(args.preset)
    cfg, page, max_blocks = model.config, 16, 64
    ctas = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    for rows in args.rows:
        shape = (2, cfg.num_hidden_layers, rows * max_blocks * page, cfg.num_key_value_heads, cfg.head_dim)
        cache = (torch.randn(shape, device="cuda") * 0.5).to(torch.bfloat16)
        attn = TritonPagedAttention(cache, page, cfg.rope_theta, max_blocks * page)
        attn.batch = decode_batch(rows, args.context, page, max_blocks)
        h = torch.randn(rows, cfg.hidden_size, device="cuda").to(torch.bfloat16)
        programs = rows * cfg.num_key_value_heads * 16  # at most 16 splits
        st = Stamps(cfg.num_hidden_layers, rows, programs, ctas)
        restore = patch(st, cfg.hidden_size)
        try:
            with torch.inference_mode():
                graph = capture(lambda h=h, attn=attn: run_loop_fused(model, h, attn))
                ms = replay_ms(graph, args.replays, warmup=3)
                # Stamps of one replay only: the merger (event 5) can differ between replays.
                for buf in (st.qkv, st.o, st.attn, st.norm):
                    buf.zero_()
                graph.replay()
                torch.cuda.synchronize()
        finally:
            restore()
        line = {"tag": args.tag, "rows": rows, "context": args.context, "loop_ms_with_stamps": round(ms, 4)}
        print(json.dumps({**line, "per_layer_us": summarize(st)}), flush=True)
        del cache, attn


if __name__ == "__main__":
    main()
