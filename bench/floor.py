"""The floor model: the least time a workload can take on a GPU, from the bytes it must read and the FLOPs
it must do.

Per decode step (one loop over every row): the layer weights once, each row's K/V of its loop plane, and
the matmul and attention arithmetic; a step takes at least max(bytes / bandwidth, FLOPs / matmul rate).
A generated token takes `depth` such steps (4 at full depth, ~2.4 at exit_threshold 0.5) and one lm_head
row; its prompt's prefill (every loop, every token) is arithmetic that the decode batch's weight stream
can carry, so it adds FLOPs, not weight bytes. A prompt's tokens found in the prefix cache add no
FLOPs (the best case: a shared prefix computed once), but their K/V is read at every step, by every row
(`--prefix-read-once`: once a step for all rows, as a cascade attention that splits the shared prefix
from each row's own positions would read it). The GPUs'
figures are measured ones (GPUS): the H200 reads 4,221 GB/s and multiplies bf16 at 789 TFLOP/s; the
H100 copies 3.0 TB/s (bytes read and written), taken as 2,950 GB/s read at the H200's ratio of read to
copy, and multiplies at 798 TFLOP/s. With FP8 weights (`--quantization fp8`, W8A8) a weight is one byte and
the layers' matmuls are taken at twice the bf16 rate (Hopper's e4m3 tensor-core rate; not measured here);
the lm_head and the K/V stay bf16.

    python -m bench.floor                                # the serving matrix's workloads, full depth
    python -m bench.floor --depth 2.4 --gpu h100         # with early exit's mean depth, on an H100
    python -m bench.floor --quantization fp8             # FP8 layer weights
    python -m bench.floor --prefix-read-once             # the shared prefix's K/V read once a step

The TTFT columns are the prompt's own prefill at the matmul rate (every loop over its uncached tokens): for
one prompt alone, and for the median request of a wave, `concurrency` prompts arriving together and served
one after another (fixed output lengths make a closed-loop client's requests end, and their successors
arrive, together). Neither counts the front end, the queue behind running work, or attention FLOPs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    hbm_bytes_per_s: float
    matmul_flops_per_s: float


GPUS = {"h200": Gpu(4.221e12, 789e12), "h100": Gpu(2.95e12, 798e12)}
H200 = GPUS["h200"]


@dataclass(frozen=True)
class Shape:
    """The Ouro-1.4B shape (bf16)."""

    layers: int = 24
    hidden: int = 2048
    intermediate: int = 5632
    kv_heads: int = 16
    head_dim: int = 128
    vocab: int = 49152
    loops: int = 4
    elem: int = 2  # bytes per bf16 value (K/V, lm_head, activations)
    fp8: bool = False  # the layer weights in FP8 (one byte each), their matmuls e4m3 x e4m3

    @property
    def weight_elem(self) -> int:
        """Bytes per layer weight."""
        return 1 if self.fp8 else self.elem

    @property
    def matmul_speedup(self) -> float:
        """The layer matmuls' rate against bf16's: e4m3 tensor cores run twice as many FLOPs."""
        return 2.0 if self.fp8 else 1.0

    @property
    def layer_params(self) -> int:
        """Weights of one loop (all layers): q, k, v, o and the gated MLP."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return self.layers * (2 * h * h + 2 * h * kv + 3 * h * self.intermediate)

    @property
    def kv_bytes_per_position(self) -> int:
        """K and V of one position in one loop plane, every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.elem


def step_floor(shape: Shape, rows: int, context: float, gpu: Gpu = H200, shared: float = 0) -> float:
    """Seconds of one decode loop over `rows` one-token rows whose planes hold `context` positions, the
    first `shared` of them the same for every row and read once for all."""
    weight = shape.layer_params * shape.weight_elem
    kv = (rows * (context - shared) + shared) * shape.kv_bytes_per_position
    matmul = 2 * rows * shape.layer_params / shape.matmul_speedup  # in bf16-rate FLOPs
    flops = matmul + 4 * rows * context * shape.hidden * shape.layers
    return max((weight + kv) / gpu.hbm_bytes_per_s, flops / gpu.matmul_flops_per_s)


def prefill_floor(shape: Shape, computed: int, gpu: Gpu = H200) -> float:
    """Seconds of one prompt's prefill: its `computed` (uncached) tokens through every loop's matmuls."""
    return 2 * computed * shape.loops * shape.layer_params / shape.matmul_speedup / gpu.matmul_flops_per_s


def token_floor(
    shape: Shape,
    concurrency: int,
    prompt: int,
    output: int,
    depth: float,
    gpu: Gpu = H200,
    cached: int = 0,
    prefix_once: bool = False,
) -> float:
    """Seconds per round in which each of `concurrency` requests gains one token, at steady state;
    `cached` of the prompt's tokens come from the prefix cache (with prefix_once, their K/V is read once a
    step for all rows)."""
    context = prompt + output / 2  # the mean context over a request's output
    lm_head = max(shape.vocab * shape.hidden * shape.elem / gpu.hbm_bytes_per_s,
                  2 * concurrency * shape.vocab * shape.hidden / gpu.matmul_flops_per_s)  # fmt: skip
    prefill = concurrency * prefill_floor(shape, prompt - cached, gpu) / output
    shared = cached if prefix_once else 0
    return depth * step_floor(shape, concurrency, context, gpu, shared) + lm_head + prefill


def floor_tok_s(
    shape: Shape,
    concurrency: int,
    prompt: int,
    output: int,
    depth: float,
    gpu: Gpu = H200,
    cached: int = 0,
    prefix_once: bool = False,
) -> float:
    """The most output tokens a second a workload can reach."""
    return concurrency / token_floor(shape, concurrency, prompt, output, depth, gpu, cached, prefix_once)


def wave_ttft_floor(shape: Shape, concurrency: int, computed: int, gpu: Gpu = H200) -> float:
    """Seconds to the median request's first token when `concurrency` prompts arrive together and are
    prefilled in arrival order at the matmul rate: (concurrency + 1) / 2 prompts' prefill."""
    return (concurrency + 1) / 2 * prefill_floor(shape, computed, gpu)


def main() -> None:
    from bench.matrix import ALL_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=float, default=4.0, help="mean loops a generated token runs")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none", help="the layer weights")
    p.add_argument("--prefix-read-once", action="store_true", help="a shared prefix's K/V read once a step")
    args = p.parse_args()
    shape, gpu = Shape(fp8=args.quantization == "fp8"), GPUS[args.gpu]
    print(f"one loop's weights {shape.layer_params * shape.weight_elem / 1e9:.2f} GB; depth {args.depth}")
    print("| workload | step floor | ms per token round | floor tok/s | TTFT floor: alone / wave median |")
    print("|---|---|---|---|---|")
    for w in ALL_WORKLOADS:
        prompt = w.prefix_len + w.input_len
        once = args.prefix_read_once
        step = step_floor(shape, w.concurrency, prompt + w.output_len / 2, gpu, w.prefix_len if once else 0)
        rnd = token_floor(shape, w.concurrency, prompt, w.output_len, args.depth, gpu, w.prefix_len, once)
        tok_s = floor_tok_s(shape, w.concurrency, prompt, w.output_len, args.depth, gpu, w.prefix_len, once)
        alone = prefill_floor(shape, w.input_len, gpu) * 1e3
        wave = wave_ttft_floor(shape, w.concurrency, w.input_len, gpu) * 1e3
        ttft = f"{alone:.2f} / {wave:.1f} ms"
        print(f"| {w.name} | {step * 1e3:.3f} ms | {rnd * 1e3:.3f} | {tok_s:,.0f} | {ttft} |")


if __name__ == "__main__":
    main()
