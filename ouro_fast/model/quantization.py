"""FP8 weights (`quantization="fp8"`): the linear layers' weights in float8 e4m3, one scale per output row.

A weight w [N, K] is stored as q = e4m3(w / s) with s[n] = max|w[n, :]| / 448 (e4m3's largest value),
so every row uses the format's whole range. Quantized at load time from the checkpoint's weights: the
attention's q/k/v/o and the MLP's gate/up/down projections of every layer. The embedding, the norms,
the exit gate, the lm_head and the KV cache keep the model's dtype.

The math of a quantized matmul is fixed here, in PyTorch (reference_linear): the products of the
activations with the FP8 values in fp32, column n scaled by s[n], rounded once to the activations'
dtype. The Triton kernels (kernels/fp8.py) compute the same; this module needs no triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("fp8",)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# A zero row's scale: any positive value quantizes it to zeros; this one keeps 1/s finite.
_MIN_SCALE = 1e-12


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's weight [N, K] in FP8 with a float32 scale per output row."""

    data: torch.Tensor  # float8_e4m3fn [N, K], contiguous
    scale: torch.Tensor  # float32 [N], on data's device

    def __post_init__(self):
        d, s = self.data, self.scale
        if d.dtype != FP8_DTYPE or d.dim() != 2 or not d.is_contiguous():
            raise ValueError(
                f"FP8 data must be contiguous float8_e4m3fn [N, K], got {d.dtype} {tuple(d.shape)}"
            )
        if s.dtype != torch.float32 or s.shape != d.shape[:1] or s.device != d.device:
            got = f"{s.dtype} {tuple(s.shape)} on {s.device}"
            raise ValueError(f"FP8 scale must be float32 [{d.shape[0]}] on {d.device}, got {got}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the FP8 values stand for, [N, K] in dtype (rounded once from fp32)."""
        return (self.data.float() * self.scale[:, None]).to(dtype)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] (any float dtype) -> Fp8Weight on w's device, each row scaled to e4m3's range and rounded
    to nearest."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"need a float weight [N, K], got {w.dtype} {tuple(w.shape)}")
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q.contiguous(), scale.contiguous())


def reference_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [..., K] @ w.T as the kernels compute it: fp32 products with the FP8 values, column n scaled by
    s[n], rounded once to x's dtype."""
    return (F.linear(x.float(), w.data.float()) * w.scale).to(x.dtype)


def w8a8_reference_linear(x: torch.Tensor, w: Fp8Weight, chunk: int = 256) -> torch.Tensor:
    """x [M, K] @ w.T as the Hopper tensor-core kernel computes it (kernels/tc_gemm.py, W8A8): each chunk of
    `chunk` columns of each row of x quantized to e4m3 with its own scale (the chunk's largest magnitude
    maps to FP8_MAX), fp32 products of the FP8 values, each chunk's sum times its scale, added in chunk
    order; column n scaled by s[n]; rounded once to x's dtype. K must be a multiple of chunk."""
    m, k = x.shape
    if k % chunk or w.shape[1] != k:
        raise ValueError(f"need x [M, {w.shape[1]}] with K a multiple of {chunk}, got {tuple(x.shape)}")
    xc = x.float().view(m, k // chunk, chunk)
    xs = xc.abs().amax(dim=2, keepdim=True).clamp_min(1e-30) / FP8_MAX  # [M, chunks, 1]
    q = (xc / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    wc = w.data.float().view(w.shape[0], k // chunk, chunk)
    out = torch.zeros(m, w.shape[0], dtype=torch.float32, device=x.device)
    for c in range(k // chunk):
        out += (q[:, c] @ wc[:, c].T) * xs[:, c]
    return (out * w.scale).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """x @ w.T for a plain or an FP8 weight (in PyTorch)."""
    return reference_linear(x, w) if isinstance(w, Fp8Weight) else F.linear(x, w)


def cat_weights(weights: tuple) -> torch.Tensor | Fp8Weight:
    """Weights stacked along the output rows (fuse()): plain tensors, or FP8 ones with their scales."""
    if all(isinstance(w, Fp8Weight) for w in weights):
        return Fp8Weight(torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights]))
    if any(isinstance(w, Fp8Weight) for w in weights):
        raise ValueError("cannot fuse FP8 weights with plain ones")
    return torch.cat(weights).detach()


def check_checkpoint_quantization(qc: object) -> None:
    """ValueError unless config.json's quantization_config is one this loader reads: compressed-tensors
    with FP8 (float, 8-bit) weights, a scale per channel or per tensor, and activations unquantized or
    quantized dynamically (which needs nothing: the Hopper tensor-core matmul quantizes activations itself,
    other matmuls keep them in the model's dtype)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ValueError(
            f"quantization_config: quant_method {method!r} is not supported (compressed-tensors FP8 is)"
        )
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config: compressed-tensors without config_groups")
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if (
            w.get("type") != "float"
            or w.get("num_bits") != 8
            or w.get("strategy") not in ("channel", "tensor")
        ):
            raise ValueError(
                f"quantization_config: group {name!r} quantizes weights as {w!r}; FP8 weights (type float, "
                "num_bits 8) with a channel or tensor scale are supported"
            )
        act = (group or {}).get("input_activations")
        if act is not None and not act.get("dynamic", False):
            raise ValueError(
                f"quantization_config: group {name!r} has static activation scales (not supported)"
            )


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose `weight` is an Fp8Weight (not a parameter: nothing trains it)."""

    def __init__(self, weight: Fp8Weight):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_linear(x, self.weight)

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"in_features={k}, out_features={n}, fp8"


def check_quantization(name: str | None) -> None:
    """ValueError unless name is None or a supported scheme."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or none), got {name!r}")


def has_fp8_weights(module: nn.Module) -> bool:
    """Whether any weight of the module is an Fp8Weight (quantized at load, or stored so)."""
    return any(isinstance(v, Fp8Weight) for sub in module.modules() for v in vars(sub).values())


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the module's weights: parameters, buffers, fused and FP8 weights (a tied one counted once)."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        seen[t.data_ptr()] = t.nbytes
    for sub in module.modules():
        for value in vars(sub).values():  # fused weights are plain attributes
            if isinstance(value, Fp8Weight):
                seen[value.data.data_ptr()] = value.nbytes
            elif isinstance(value, torch.Tensor):
                seen[value.data_ptr()] = value.nbytes
    return sum(seen.values())
