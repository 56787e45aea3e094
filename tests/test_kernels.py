"""Triton kernels against plain PyTorch references; on a CPU-only machine via TRITON_INTERPRET=1."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Must be set before triton is imported: the interpreter runs the kernels with numpy.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (the `gpu` extra: pip install 'triton>=3.0')")

from ouro_fast.core_py.block_table import BlockTable  # noqa: E402
from ouro_fast.kernels import (  # noqa: E402
    add_rms_norm,
    paged_attention,
    propagate_kv,
    rms_norm,
    rope_cos_sin_table,
    rope_write_kv,
    silu_and_mul,
)
from ouro_fast.kernels.prefill_attention import attention_config  # noqa: E402
from ouro_fast.model import ouro  # noqa: E402
from ouro_fast.model.attention import PagedBatch, PagedTorchAttention, causal_attend  # noqa: E402
from ouro_fast.model.config import OuroConfig  # noqa: E402
from ouro_fast.model.ouro import OuroForCausalLM, RMSNorm, apply_rope, rope_cos_sin  # noqa: E402
from ouro_fast.model.triton_attention import TritonBatch, TritonPagedAttention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    # One bf16/fp16 rounding of the output plus P rounded to the dtype before P @ V.
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)).to(dtype).to(DEV)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEV)


# ---- paged attention ----

# (request slot, loop, first position, length): context 1, a decode at a block boundary,
# a prefill from 0, a chunk continuing mid-block at another loop, a padding row.
MIXED_ROWS = [(0, 0, 0, 1), (0, 2, 16, 1), (1, 1, 0, 13), (1, 3, 5, 9), (2, 1, 30, 1), (2, 0, 0, 0)]
DECODE_ROWS = [(0, 0, 0, 1), (0, 3, 15, 1), (1, 1, 16, 1), (2, 2, 30, 1), (1, 0, 0, 0)]
SHORT_ROWS = [(0, 1, 0, 2), (1, 2, 7, 2), (2, 0, 3, 1)]
# Rows of several query tiles, with a padding row between them and a decode row last.
LONG_ROWS = [(0, 0, 0, 40), (1, 1, 0, 0), (2, 2, 3, 17), (1, 0, 0, 1)]


def paged_case(rows, block_size, num_loops=4, extra_tokens=2):
    """A BlockTable covering the rows, their tables and metadata, tokens laid out in reverse row order."""
    bt = BlockTable(128, block_size, num_loops, 3, 40 // block_size + 1)
    for slot in range(3):
        assert bt.allocate(slot, max([s + n for sl, _, s, n in rows if sl == slot], default=0))
    tok_off, off = [0] * len(rows), 0
    for r in reversed(range(len(rows))):
        tok_off[r], off = off, off + rows[r][3]
    tables = i32(np.stack([bt.tables[sl, lp] for sl, lp, _, _ in rows]))
    meta = (tables, i32([s for _, _, s, _ in rows]), i32([n for *_, n in rows]), i32(tok_off))
    return bt, meta, off + extra_tokens


def reference_attention(bt, rows, tok_off, q, kc, vc):
    out = {}
    for r, (slot, loop, start, n) in enumerate(rows):
        if n == 0:
            continue
        kv = np.zeros(start + n, dtype=np.int64)
        bt.fill_slot_mapping(slot, loop, 0, start + n, kv, 0)
        kv = torch.from_numpy(kv).to(DEV)
        out[r] = causal_attend(q[tok_off[r] : tok_off[r] + n], kc[kv], vc[kv], start)
    return out


@pytest.mark.parametrize(
    "rows, hq, hkv, d, block_size, dtype, max_q_len",
    [
        (MIXED_ROWS, 4, 2, 16, 4, torch.float32, 16),
        (MIXED_ROWS, 6, 2, 32, 16, torch.bfloat16, 16),
        (MIXED_ROWS, 4, 4, 48, 8, torch.float32, 13),
        (MIXED_ROWS, 8, 1, 16, 4, torch.float16, 32),
        (DECODE_ROWS, 2, 2, 64, 8, torch.float32, 1),
        (DECODE_ROWS, 8, 1, 16, 4, torch.bfloat16, 1),
        (DECODE_ROWS, 6, 2, 16, 16, torch.float32, 1),
        (SHORT_ROWS, 4, 2, 16, 4, torch.bfloat16, 2),
        (LONG_ROWS, 4, 4, 16, 8, torch.float32, 64),
        (LONG_ROWS, 8, 2, 32, 8, torch.bfloat16, 40),
    ],
    ids=[
        "gqa2-fp32",
        "gqa3-bf16",
        "mha-d48-fp32",
        "gqa8-fp16",
        "decode-mha-fp32",
        "decode-gqa8-bf16",
        "decode-gqa3-fp32",
        "short-bf16",
        "long-mha-fp32",
        "long-gqa4-bf16",
    ],  # fmt: skip
)
def test_paged_attention_matches_reference(rows, hq, hkv, d, block_size, dtype, max_q_len):
    bt, (tables, q_start, lens, tok_off), n = paged_case(rows, block_size)
    slots = bt.num_blocks * block_size
    q = randn(n, hq, d, dtype=dtype, seed=1)
    kc, vc = randn(slots, hkv, d, dtype=dtype, seed=2), randn(slots, hkv, d, dtype=dtype, seed=3)
    sentinel = torch.full_like(q, 7.0)
    out = paged_attention(
        q, kc, vc, tables, q_start, lens, tok_off, block_size, max_q_len, out=sentinel.clone()
    )
    ref = reference_attention(bt, rows, tok_off.tolist(), q, kc, vc)
    covered = torch.zeros(n, dtype=torch.bool)
    for r, expect in ref.items():
        o = tok_off[r].item()
        torch.testing.assert_close(out[o : o + rows[r][3]], expect, **TOL[dtype])
        covered[o : o + rows[r][3]] = True
    # Tokens of no row (padding) are never written.
    assert torch.equal(out[~covered.to(DEV)], sentinel[~covered.to(DEV)])


@pytest.mark.parametrize("block_q, block_n", [(32, 16), (64, 32), (16, 8)])
def test_paged_attention_with_a_given_config_matches_reference(block_q, block_n):
    # The config override (benchmarks) tiles differently and must give the same attention; small key
    # tiles put whole tiles before a query tile (read without the causal mask).
    rows = LONG_ROWS
    bt, (tables, q_start, lens, tok_off), n = paged_case(rows, 8)
    q = randn(n, 4, 16, seed=6)
    kc, vc = randn(bt.num_blocks * 8, 4, 16, seed=7), randn(bt.num_blocks * 8, 4, 16, seed=8)
    cfg = {"BLOCK_Q": block_q, "BLOCK_N": block_n, "USE_DOT": True, "num_warps": 4, "num_stages": 2}
    out = paged_attention(q, kc, vc, tables, q_start, lens, tok_off, 8, 64, config=cfg)
    for r, expect in reference_attention(bt, rows, tok_off.tolist(), q, kc, vc).items():
        o = tok_off[r].item()
        torch.testing.assert_close(out[o : o + rows[r][3]], expect, **TOL[torch.float32])


def test_paged_attention_reads_cache_through_kv_strides():
    # One layer of a [2, L, slots, Hkv, D] cache is a strided view: the kernel must honour it.
    rows = MIXED_ROWS[:4]
    bt, (tables, q_start, lens, tok_off), n = paged_case(rows, 4)
    cache = randn(2, 3, bt.num_blocks * 4, 2, 16, seed=4)
    q = randn(n, 4, 16, seed=5)
    out = paged_attention(q, cache[0, 1], cache[1, 1], tables, q_start, lens, tok_off, 4, 16)
    for r, expect in reference_attention(bt, rows, tok_off.tolist(), q, cache[0, 1], cache[1, 1]).items():
        o = tok_off[r].item()
        torch.testing.assert_close(out[o : o + rows[r][3]], expect, **TOL[torch.float32])


def test_attention_config_depends_only_on_bounds():
    assert attention_config(1, 1, 128) == {"BLOCK_Q": 1, "BLOCK_N": 32, "USE_DOT": False, "num_warps": 4}
    assert attention_config(1, 16, 128)["USE_DOT"] and attention_config(1, 16, 128)["BLOCK_Q"] == 1
    cfg = attention_config(100, 1, 128)
    assert cfg["USE_DOT"] and cfg["BLOCK_Q"] * 1 >= 16
    # About 8 query tiles for the longest row, tl.dot's M (tokens x group heads) within 16..64.
    assert [attention_config(q, 1, 128)["BLOCK_Q"] for q in (64, 128, 256, 512, 2048)] == [16, 16, 32, 64, 64]
    assert [attention_config(q, 4, 128)["BLOCK_Q"] for q in (16, 128, 512)] == [4, 16, 16]
    assert {attention_config(q, 1, 128)["num_warps"] for q in (16, 128, 512)} == {4}  # faster than 8 (H200)


# ---- RoPE + K/V write ----


@pytest.mark.parametrize("d, theta, positions", [(16, 500.0, 64), (64, 10000.0, 4096), (128, 1e6, 65536)])
def test_rope_table_is_the_models_cos_sin_bit_for_bit(d, theta, positions):
    # kernels/ computes its own table (it imports nothing from model/): the same bits as rope_cos_sin's.
    table = rope_cos_sin_table(positions, d, theta, DEV)
    cos, sin = rope_cos_sin(torch.arange(positions, device=DEV), d, theta)
    assert table.dtype == torch.float32 and table.shape == (positions, d) and table.is_contiguous()
    assert torch.equal(table, torch.cat((cos[:, : d // 2], sin[:, : d // 2]), dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(4, 2, 16), (3, 3, 32), (8, 1, 64)])
def test_rope_write_kv_matches_reference(dtype, hq, hkv, d):
    n, slots, theta = 7, 40, 10000.0
    q, k, v = (
        randn(n, hq, d, dtype=dtype, seed=6),
        randn(n, hkv, d, dtype=dtype, seed=7),
        randn(n, hkv, d, dtype=dtype, seed=8),
    )
    # The last token is padding: no write, and a position far outside the table.
    positions = torch.tensor([0, 1, 5, 17, 31, 63, 10**6], device=DEV)
    slot_mapping = torch.tensor([3, 0, 39, 12, 13, 7, -1], device=DEV)
    kc, vc = randn(slots, hkv, d, dtype=dtype, seed=9), randn(slots, hkv, d, dtype=dtype, seed=10)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    table = rope_cos_sin_table(64, d, theta, DEV)
    q_rot = rope_write_kv(q, k, v, kc, vc, slot_mapping, positions, table)

    cos, sin = rope_cos_sin(positions[:-1], d, theta)
    torch.testing.assert_close(q_rot[:-1], apply_rope(q[:-1], cos, sin), atol=1e-6, rtol=1e-6)
    kc_ref[slot_mapping[:-1]] = apply_rope(k[:-1], cos, sin)
    vc_ref[slot_mapping[:-1]] = v[:-1]
    torch.testing.assert_close(kc, kc_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(vc, vc_ref)


def test_rope_write_kv_in_place_and_without_rope():
    n, d = 5, 16
    q, k, v = randn(n, 4, d, seed=11), randn(n, 2, d, seed=12), randn(n, 2, d, seed=13)
    kc, vc = torch.zeros(10, 2, d, device=DEV), torch.zeros(10, 2, d, device=DEV)
    slot_mapping = torch.tensor([9, -1, 2, 4, 0], device=DEV)
    assert rope_write_kv(q, k, v, kc, vc, slot_mapping) is q
    written = slot_mapping >= 0
    assert torch.equal(kc[slot_mapping[written]], k[written]) and torch.equal(
        vc[slot_mapping[written]], v[written]
    )
    assert kc[[1, 3, 5, 6, 7, 8]].abs().sum() == 0
    positions = torch.arange(3, 3 + n, device=DEV)
    expect = apply_rope(q, *rope_cos_sin(positions, d, 500.0))
    got = rope_write_kv(
        q, k, v, kc, vc, slot_mapping, positions, rope_cos_sin_table(16, d, 500.0, DEV), q_out=q
    )
    assert got is q
    torch.testing.assert_close(q, expect, atol=1e-6, rtol=1e-6)


# ---- propagation ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_propagate_kv_copies_every_layer_and_respects_count(dtype):
    cache = randn(2, 3, 32, 2, 16, dtype=dtype, seed=14)
    src = torch.tensor([1, 4, 4, 20, 9, 30], device=DEV)
    dst = torch.tensor([2, 5, 6, 21, -1, 31], device=DEV)
    ref = cache.clone()
    ref[:, :, dst[:4]] = ref[:, :, src[:4]]
    # Pair 4 has dst -1 (skipped); pair 5 lies beyond count.
    propagate_kv(cache, src, dst, count=torch.tensor([5], device=DEV))
    assert torch.equal(cache, ref)
    propagate_kv(cache, src[:0], dst[:0])
    propagate_kv(cache, src, dst, count=torch.tensor([0], dtype=torch.int32, device=DEV))
    assert torch.equal(cache, ref)
    propagate_kv(cache, src[5:], dst[5:])
    ref[:, :, 31] = ref[:, :, 30]
    assert torch.equal(cache, ref)


# ---- norms and SwiGLU ----


def model_rms(x, w, eps):
    norm = RMSNorm(x.shape[-1], eps).to(device=DEV, dtype=x.dtype)
    norm.weight.data.copy_(w)
    return norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, h", [(1, 64), (5, 96), (3, 256)])
def test_add_rms_norm_matches_the_model_rounding(dtype, n, h):
    eps = 1e-6
    hid, a = randn(n, h, dtype=dtype, seed=15), 3 * randn(n, h, dtype=dtype, seed=16)
    w_a, w_next = 1 + 0.1 * randn(h, dtype=dtype, seed=17), 1 + 0.1 * randn(h, dtype=dtype, seed=18)
    h_new, x = add_rms_norm(hid, a, w_a, w_next, eps)
    h_ref = hid + model_rms(a, w_a, eps)
    x_ref = model_rms(h_ref, w_next, eps)
    # Exact up to the sum's order inside rsqrt: at most one rounding step apart.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(h_new, h_ref, **tol)
    torch.testing.assert_close(x, x_ref, **tol)
    torch.testing.assert_close(rms_norm(a, w_a, eps), model_rms(a, w_a, eps), **tol)
    # In place on h.
    h_copy = hid.clone()
    add_rms_norm(h_copy, a, w_a, w_next, eps, h_out=h_copy)
    assert torch.equal(h_copy, h_new)


def test_norm_warps_grow_with_the_row_up_to_16():
    from ouro_fast.kernels import norm  # noqa: PLC0415

    assert [norm._warps(h) for h in (64, 512, 1024, 2048, 4096)] == [4, 4, 8, 16, 16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 4, 11])
def test_add_rms_norm_adds_partial_products_in_order(dtype, parts):
    # tc_gemm's cut matmuls hand fp32 partials [P, N, H]: added in order and rounded, they must give what
    # the matmul's own rounded output gives, bit for bit.
    n, h, eps = 3, 96, 1e-6
    hid, w_a, w_next = (
        randn(n, h, dtype=dtype, seed=40),
        1 + 0.1 * randn(h, dtype=dtype, seed=41),
        1 + 0.1 * randn(h, dtype=dtype, seed=42),
    )
    p = randn(parts, n, h, dtype=torch.float32, seed=43)
    total = p[0].clone()
    for i in range(1, parts):
        total = total + p[i]
    want = add_rms_norm(hid, total.to(dtype), w_a, w_next, eps)
    got = add_rms_norm(hid, p, w_a, w_next, eps)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="partials must be fp32"):
        add_rms_norm(hid, p[:, :, :-1].contiguous(), w_a, w_next, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, f, block", [(3, 96, 1024), (4, 200, 64), (1, 16, 16)])
def test_silu_and_mul(dtype, n, f, block):
    x = 4 * randn(n, 2 * f, dtype=dtype, seed=19)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(silu_and_mul(x, block=block), F.silu(x[:, :f]) * x[:, f:], **tol)


# ---- the backend inside the model ----

CFG = OuroConfig(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    total_ut_steps=4,
    rope_theta=10000.0,
)

# Calls of (request slot, loop, first position, length) rows: prefill chunks at several
# loops, then decode rows at different loops with a block-boundary position.
CALLS = [
    [(0, 0, 0, 7), (1, 0, 0, 5)],
    [(0, 1, 0, 7), (1, 0, 5, 6), (2, 0, 0, 1)],
    [(1, 1, 0, 11), (0, 2, 0, 7), (2, 1, 0, 1)],
    [(0, 0, 7, 1), (1, 2, 0, 11), (2, 2, 0, 1), (0, 3, 0, 7)],
    [(0, 1, 7, 1), (2, 3, 0, 1), (1, 3, 0, 11)],
    [(0, 2, 7, 1), (0, 0, 8, 1), (2, 0, 1, 1)],
]


def make_model(dtype):
    torch.manual_seed(0)
    model = OuroForCausalLM(CFG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("_2.weight") or name == "model.norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.to(device=DEV, dtype=dtype)


def schedule(rows, pad_rows=0, pad_tokens=0):
    """A LoopScheduler-like step for `rows`, padded with len-0 rows and slot -1 tokens."""
    bs, r = 4, len(rows) + pad_rows
    sched = SimpleNamespace(num_rows=r, num_step_tokens=sum(row[3] for row in rows) + pad_tokens)
    arr = lambda i, pad: np.array([row[i] for row in rows] + [pad] * pad_rows, dtype=np.int32)
    sched.row_kv_slot, sched.row_loop, sched.row_start, sched.row_len = (
        arr(0, 0),
        arr(1, 0),
        arr(2, 0),
        arr(3, 0),
    )
    sched.row_tok_off = np.concatenate(([0], np.cumsum(sched.row_len)[:-1])).astype(np.int32)
    pos, slots = [], []
    for slot, loop, start, n in rows:
        pos += range(start, start + n)
        s = np.zeros(n, dtype=np.int64)
        BT.fill_slot_mapping(slot, loop, start, n, s, 0)
        slots += s.tolist()
    sched.positions = np.array(pos + [0] * pad_tokens, dtype=np.int64)
    sched.slot_mapping = np.array(slots + [-1] * pad_tokens, dtype=np.int64)
    kv_slots = []
    for slot, loop, start, n in rows:
        s = np.zeros(start + n, dtype=np.int64)
        BT.fill_slot_mapping(slot, loop, 0, start + n, s, 0)
        kv_slots.append(torch.from_numpy(s).to(DEV))
    ref = PagedBatch(
        slot_mapping=torch.from_numpy(sched.slot_mapping[: sched.num_step_tokens - pad_tokens]).to(DEV),
        row_token_start=sched.row_tok_off[: len(rows)].tolist(),
        row_len=sched.row_len[: len(rows)].tolist(),
        row_q_start=sched.row_start[: len(rows)].tolist(),
        row_kv_slots=kv_slots,
    )
    return sched, ref, bs


BT = BlockTable(40, 4, 4, 3, 4)
for _slot in range(3):
    assert BT.allocate(_slot, 12)


@pytest.mark.parametrize(
    "dtype, fused_rope", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)]
)
def test_backend_run_loop_matches_paged_torch_attention(dtype, fused_rope, monkeypatch):
    model = make_model(dtype)
    shape = (2, CFG.num_hidden_layers, BT.num_blocks * 4, CFG.num_key_value_heads, CFG.head_dim)
    ref_attn = PagedTorchAttention(torch.zeros(shape, dtype=dtype, device=DEV))
    theta = CFG.rope_theta if fused_rope else None
    tri_attn = TritonPagedAttention(torch.zeros(shape, dtype=dtype, device=DEV), 4, theta, max_positions=64)
    assert tri_attn.applies_rope == fused_rope
    worst = 0.0
    for i, rows in enumerate(CALLS):
        decode = all(row[3] == 1 for row in rows)
        # Decode calls are padded like a CUDA-graph bucket: a len-0 row and a slot -1 token.
        sched, ref_batch, bs = schedule(rows, pad_rows=int(decode), pad_tokens=int(decode))
        n = sched.num_step_tokens - int(decode)
        h = torch.randn(sched.num_step_tokens, CFG.hidden_size, generator=gen(100 + i)).to(DEV, dtype)
        positions = torch.from_numpy(sched.positions).to(DEV)
        with torch.no_grad():
            ref_attn.batch = ref_batch
            expect = model.run_loop(h[:n], positions[:n], ref_attn)
            tri_attn.batch = TritonBatch.from_schedule(sched, BT.tables, DEV, max_q_len=1 if decode else None)
            with monkeypatch.context() as m:
                if fused_rope:
                    # The proposed ouro.py change: a backend with applies_rope gets unrotated q, k.
                    m.setattr(ouro, "apply_rope", lambda x, cos, sin: x)
                got = model.run_loop(h, positions, tri_attn)
        if dtype == torch.float32:
            torch.testing.assert_close(got[:n], expect, atol=2e-5, rtol=2e-5)
        worst = max(worst, (got[:n].float() - expect.float()).abs().max().item())
    if dtype == torch.float32:
        torch.testing.assert_close(tri_attn.kv_cache, ref_attn.kv_cache, atol=2e-5, rtol=2e-5)
    else:
        # bf16: two bf16 pipelines that round differently (P @ V in bf16, sums' order); outputs are
        # RMS-normed (entries of order 1), so this bounds the drift after 2 layers x 6 calls.
        assert worst < 0.1, worst
        torch.testing.assert_close(tri_attn.kv_cache.float(), ref_attn.kv_cache.float(), atol=0.1, rtol=0.05)


def fused_run_loop(model, h, attn):
    """run_loop rebuilt from the kernels: the recipe proposed to the lead (RoPE inside attn)."""
    layers, eps = model.model.layers, model.config.rms_norm_eps
    n, heads, kv_heads, d = h.shape[0], CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
    x = rms_norm(h, layers[0].input_layernorm.weight, eps)
    for i, layer in enumerate(layers):
        sa, mlp = layer.self_attn, layer.mlp
        q, k, v = (
            sa.q_proj(x).view(n, heads, d),
            sa.k_proj(x).view(n, kv_heads, d),
            sa.v_proj(x).view(n, kv_heads, d),
        )
        a = sa.o_proj(attn(i, q, k, v).reshape(n, heads * d))
        h, m = add_rms_norm(h, a, layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight, eps)
        gate_up = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight))
        out = mlp.down_proj(silu_and_mul(F.linear(m, gate_up)))
        w_next = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.model.norm.weight
        h, x = add_rms_norm(h, out, layer.post_attention_layernorm_2.weight, w_next, eps)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loop_recipe_matches_run_loop(dtype):
    model = make_model(dtype)
    shape = (2, CFG.num_hidden_layers, BT.num_blocks * 4, CFG.num_key_value_heads, CFG.head_dim)
    ref_attn = PagedTorchAttention(torch.zeros(shape, dtype=dtype, device=DEV))
    tri_attn = TritonPagedAttention(torch.zeros(shape, dtype=dtype, device=DEV), 4, CFG.rope_theta, 64)
    for i, rows in enumerate(CALLS[:3]):
        sched, ref_batch, _ = schedule(rows)
        h = torch.randn(sched.num_step_tokens, CFG.hidden_size, generator=gen(200 + i)).to(DEV, dtype)
        with torch.no_grad():
            ref_attn.batch = ref_batch
            expect = model.run_loop(h, torch.from_numpy(sched.positions).to(DEV), ref_attn)
            tri_attn.batch = TritonBatch.from_schedule(sched, BT.tables, DEV)
            got = fused_run_loop(model, h, tri_attn)
        tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
        torch.testing.assert_close(got, expect, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_loop_fused_matches_run_loop(dtype):
    # The engine's loop (fused model, skinny matmuls up to 16 tokens, cuBLAS beyond) against the
    # reference loop, over calls of 3 to 20 tokens.
    from ouro_fast.model.triton_loop import run_loop_fused  # noqa: PLC0415

    model = make_model(dtype)
    fused = make_model(dtype)
    fused.fuse()
    shape = (2, CFG.num_hidden_layers, BT.num_blocks * 4, CFG.num_key_value_heads, CFG.head_dim)
    ref_attn = PagedTorchAttention(torch.zeros(shape, dtype=dtype, device=DEV))
    tri_attn = TritonPagedAttention(torch.zeros(shape, dtype=dtype, device=DEV), 4, CFG.rope_theta, 64)
    sizes = set()
    for i, rows in enumerate(CALLS):
        sched, ref_batch, _ = schedule(rows)
        sizes.add(sched.num_step_tokens)
        h = torch.randn(sched.num_step_tokens, CFG.hidden_size, generator=gen(300 + i)).to(DEV, dtype)
        with torch.no_grad():
            ref_attn.batch = ref_batch
            expect = model.run_loop(h, torch.from_numpy(sched.positions).to(DEV), ref_attn)
            tri_attn.batch = TritonBatch.from_schedule(sched, BT.tables, DEV)
            got = run_loop_fused(fused, h.clone(), tri_attn)
        tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
        torch.testing.assert_close(got, expect, **tol)
    assert min(sizes) <= 16 < max(sizes)  # both the skinny and the cuBLAS matmuls ran
