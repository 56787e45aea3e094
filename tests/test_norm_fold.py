"""bench/norm_fold_check.py: the norm folded into the next matmul is the same function (float64), and in
bf16 its error against float64 is no larger than today's path's (docs/design.md, "Known limits")."""

from __future__ import annotations

import torch

from bench import norm_fold_check as nf


def test_fold_is_the_same_function_in_float64():
    args = [t.double() for t in nf.inputs(rows=3, hidden=256, out=96, seed=1)]
    ref, fold = nf.reference(*args, rounded=False), nf.folded(*args, rounded=False)
    assert torch.allclose(fold, ref, rtol=1e-10, atol=1e-12)


def test_fold_error_in_bf16_is_no_larger_than_todays():
    for rows, seed in ((1, 0), (8, 1)):
        e = nf.errors(rows, seed, hidden=512, out=384)
        assert e["folded"]["max"] <= 1.25 * e["reference"]["max"]
        assert 0 < e["folded"]["mean"] <= 1.25 * e["reference"]["mean"]
