"""o_proj merging the decode attention's split partials (kernels/merge_o_proj.py): the merged output bit for
bit (through an identity weight), the product against float64, padding rows untouched, the loop with it."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (the `gpu` extra: pip install 'triton>=3.0')")

from ouro_fast.kernels import fused_decode_attention, merge_o_proj  # noqa: E402
from ouro_fast.kernels.merge_o_proj import DeferredMerge, merged_o_proj  # noqa: E402
from ouro_fast.model.fast_loop import run_loop_fused  # noqa: E402
from ouro_fast.model.triton_attention import TritonBatch, TritonPagedAttention  # noqa: E402
from tests.test_decode_attention import CONTEXTS, INT_VIEW, nan_scratch, rope_case  # noqa: E402, F401
from tests.test_kernels import BT, CFG, gen, make_model, schedule  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def deferred_and_merged(case, splits: int):
    """(DeferredMerge, the attention's own merged output) for one case, each on its own cache copy."""
    outs = []
    for defer in (True, False):
        kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
        cfg = {"NUM_SPLITS": splits, "BLOCK_N": 8}
        inputs = {**case, "k_cache": kc, "v_cache": vc}
        outs.append(fused_decode_attention(**inputs, block_size=4, config=cfg, defer_merge=defer))
    return outs


def row_tokens(case) -> torch.Tensor:
    """The tokens of rows that run (row_len > 0)."""
    return case["row_tok_off"][case["row_len"] > 0].long()


@pytest.mark.usefixtures("nan_scratch")
@pytest.mark.parametrize("w_mode", [0, 1, 2])
@pytest.mark.parametrize("hpp", [1, 2])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_identity_weight_gives_the_merged_output_bit_for_bit(dtype, hq, hkv, hpp, w_mode):
    # With w = I each output feature is one merged value times 1 plus zeros: exact, so the slots' sum is the
    # attention's own merged output, bit for bit, for every token of a row that runs.
    d = 16
    case = rope_case(CONTEXTS, 4, hq, hkv, d, dtype, seed=hq + hpp)
    parts, expect = deferred_and_merged(case, 4)
    assert isinstance(parts, DeferredMerge) and parts.splits == 4
    w = torch.eye(hq * d, dtype=dtype, device=DEV)
    slots = merged_o_proj(parts, w, {"BN": 16, "HPP": hpp, "W_MODE": w_mode, "num_warps": 2})
    assert slots.shape == (hq // hpp, case["q"].shape[0], hq * d) and slots.dtype == torch.float32
    toks = row_tokens(case)
    got = slots.sum(0)[toks].to(dtype)
    want = expect.reshape(expect.shape[0], -1)[toks]
    assert torch.equal(got.view(INT_VIEW[dtype]), want.contiguous().view(INT_VIEW[dtype]))
    # Tokens of no row and of the padding row: never written (NaN-filled by nan_scratch).
    rest = torch.ones(case["q"].shape[0], dtype=torch.bool, device=DEV)
    rest[toks] = False
    assert bool(slots[:, rest].isnan().all())


@pytest.mark.usefixtures("nan_scratch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_product_matches_linear_of_the_merged_output(dtype):
    hq, d = 4, 16
    case = rope_case(CONTEXTS, 4, hq, 2, d, dtype, seed=7)
    parts, merged = deferred_and_merged(case, 8)
    w = (0.2 * torch.randn(24, hq * d, generator=gen(5))).to(DEV, dtype)  # 24: BN 16 leaves a partial block
    got = merged_o_proj(parts, w, {"BN": 16, "HPP": 2, "W_MODE": 1, "num_warps": 2}).sum(0)
    toks = row_tokens(case)
    want = merged.reshape(merged.shape[0], -1)[toks].double() @ w.double().T
    torch.testing.assert_close(got[toks].double(), want, atol=1e-5, rtol=1e-5)


def test_one_split_is_never_deferred():
    case = rope_case([5, 9], 4, 2, 2, 16, torch.float32, seed=3)
    cfg = {"NUM_SPLITS": 1, "BLOCK_N": 8}
    out = fused_decode_attention(**case, block_size=4, config=cfg, defer_merge=True)
    assert isinstance(out, torch.Tensor) and out.shape == case["q"].shape


def test_bad_weights_and_configs_are_refused():
    case = rope_case([5, 9], 4, 2, 2, 16, torch.float32, seed=3)
    parts, _ = deferred_and_merged(case, 4)
    with pytest.raises(ValueError, match="w must be"):
        merged_o_proj(parts, torch.zeros(8, 31, device=DEV))
    with pytest.raises(ValueError, match="multiple of HPP"):
        merged_o_proj(parts, torch.zeros(8, 32, device=DEV), {"HPP": 4})
    assert merge_o_proj._config("128:1") == {"BN": 128, "HPP": 1, "W_MODE": 2, "num_warps": 8}
    assert merge_o_proj._config("") == {"BN": 64, "HPP": 2, "W_MODE": 2, "num_warps": 8}


def test_applies_only_up_to_its_rows(monkeypatch):
    monkeypatch.setattr(merge_o_proj, "MAX_ROWS", 0)
    assert not merge_o_proj.applies(1)
    monkeypatch.setattr(merge_o_proj, "MAX_ROWS", 2)
    assert merge_o_proj.applies(1) and merge_o_proj.applies(2) and not merge_o_proj.applies(3)
    assert not merge_o_proj.applies(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loop_with_the_merge_in_o_proj_matches_the_loop_without(dtype, monkeypatch):
    # Decode calls (one token a row, a padding row, max_q_len 1) through run_loop_fused, the merge in the
    # attention and then in o_proj: the same K/V written, outputs within the sums' order.
    model = make_model(dtype)
    model.fuse()
    monkeypatch.setattr(merge_o_proj, "CONFIG", {"BN": 32, "HPP": 2, "W_MODE": 1, "num_warps": 2})
    shape = (2, CFG.num_hidden_layers, BT.num_blocks * 4, CFG.num_key_value_heads, CFG.head_dim)
    calls = [[(0, 0, 7, 1), (2, 2, 0, 1)], [(0, 2, 7, 1), (0, 0, 8, 1), (2, 0, 1, 1)]]
    results = {}
    for rows in (0, 16):
        monkeypatch.setattr(merge_o_proj, "MAX_ROWS", rows)
        attn = TritonPagedAttention(
            (0.5 * torch.randn(shape, generator=gen(9))).to(DEV, dtype), 4, CFG.rope_theta, 64
        )
        outs = []
        for i, call in enumerate(calls):
            sched, _, _ = schedule(call, pad_rows=1, pad_tokens=1)
            attn.batch = TritonBatch.from_schedule(sched, BT.tables, DEV, max_q_len=1)
            h = torch.randn(sched.num_step_tokens, CFG.hidden_size, generator=gen(40 + i)).to(DEV, dtype)
            with torch.no_grad():
                outs.append(run_loop_fused(model, h, attn)[: len(call)])
        results[rows] = (outs, attn.kv_cache)
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}
    for got, want in zip(results[16][0], results[0][0], strict=True):
        torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(results[16][1], results[0][1], **tol)


@pytest.mark.skipif(DEV == "cpu", reason="Ouro's shapes at the GPU's default configs")
@pytest.mark.usefixtures("nan_scratch")
@pytest.mark.parametrize("config", ["", "128:2:2:8", "64:2:1:8", "64:2:2:4"])
@pytest.mark.parametrize("contexts", [[70], [1, 70], [0, 33, 70, 160]], ids=["1row", "2rows", "4rows"])
def test_ouro_heads_on_the_gpu(contexts, config):
    # 16 heads of 128 in bf16, 16 splits of 16-wide tiles (the decode default up to 4 rows): the merged o bit
    # for bit through an identity weight, and o_proj's product against float64.
    case = rope_case(contexts, 16, 16, 16, 128, torch.bfloat16, seed=len(contexts))
    outs = []
    for defer in (True, False):
        inputs = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
        cfg = {"NUM_SPLITS": 16, "BLOCK_N": 16}
        outs.append(fused_decode_attention(**inputs, block_size=16, config=cfg, defer_merge=defer))
    parts, merged = outs
    cfg = merge_o_proj._config(config)
    toks = row_tokens(case)
    eye = torch.eye(2048, dtype=torch.bfloat16, device=DEV)
    got = merged_o_proj(parts, eye, cfg).sum(0)[toks].to(torch.bfloat16)
    want = merged.reshape(merged.shape[0], -1)[toks]
    assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16))
    w = (0.02 * torch.randn(2048, 2048, generator=gen(11))).to(DEV, torch.bfloat16)
    got = merged_o_proj(parts, w, cfg).sum(0)[toks].double()
    torch.testing.assert_close(got, want.double() @ w.double().T, atol=1e-4, rtol=1e-4)
