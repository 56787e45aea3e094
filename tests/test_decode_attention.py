"""Split-KV decode attention against a plain PyTorch reference and against paged_attention; the
one-launch fused decode (RoPE + K/V write + attention + merge) against the three launches, bit for bit."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: the interpreter runs the kernels with numpy.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (the `gpu` extra: pip install 'triton>=3.0')")

from ouro_fast.kernels import (  # noqa: E402
    decode_attention,
    fused_decode_attention,
    paged_attention,
    paged_decode_attention,
    rope_cos_sin_table,
    rope_write_kv,
)
from ouro_fast.kernels.split_kv_attention import decode_config  # noqa: E402
from ouro_fast.kernels.tuning import DECODE_ATTN_MAXNREG, DECODE_ATTN_MAXNREG_ROWS  # noqa: E402
from ouro_fast.model import triton_attention  # noqa: E402
from ouro_fast.model.triton_attention import TritonBatch, TritonPagedAttention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: one rounding of the output (either side of a tie can round differently).
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
}
# Contexts (query position + 1) of the rows; 0 marks a padding row. With 8 splits of whole
# 16-position tiles, contexts 1..16 use one split, 17 two, 100 seven, 300 all eight.
CONTEXTS = [1, 15, 0, 16, 17, 100, 300]


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def decode_case(contexts, block_size, hq, hkv, d, dtype, seed=0, extra_tokens=2):
    """Rows of one decode token each, in shuffled blocks; tokens laid out in reverse row order."""
    r, mb = len(contexts), max(triton_cdiv(c, block_size) for c in contexts) + 1
    need = [triton_cdiv(c, block_size) for c in contexts]
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(seed))
    tables, used = torch.full((r, mb), -1, dtype=torch.int32), 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[used : used + k]
        used += k
    lens = [int(c > 0) for c in contexts]
    tok_off = [sum(lens[i + 1 :]) for i in range(r)]
    meta = dict(
        block_tables=tables.to(DEV),
        row_q_start=torch.tensor([max(c - 1, 0) for c in contexts], dtype=torch.int32, device=DEV),
        row_len=torch.tensor(lens, dtype=torch.int32, device=DEV),
        row_tok_off=torch.tensor(tok_off, dtype=torch.int32, device=DEV),
    )
    slots = (sum(need) + 3) * block_size
    q = randn(sum(lens) + extra_tokens, hq, d, dtype=dtype, seed=seed + 1)
    kc = randn(slots, hkv, d, dtype=dtype, seed=seed + 2)
    vc = randn(slots, hkv, d, dtype=dtype, seed=seed + 3)
    return q, kc, vc, meta


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reference(q, kc, vc, meta, block_size):
    """{token: [Hq, D]} in float64: softmax(q . K / sqrt(D)) V over each row's positions 0..q_pos."""
    hq, hkv, d = q.shape[1], kc.shape[1], q.shape[2]
    out = {}
    for r in range(meta["row_len"].shape[0]):
        if meta["row_len"][r] == 0:
            continue
        pos = torch.arange(int(meta["row_q_start"][r]) + 1)
        slot = meta["block_tables"][r].cpu().long()[pos // block_size] * block_size + pos % block_size
        k = kc.cpu()[slot].double().repeat_interleave(hq // hkv, dim=1)
        v = vc.cpu()[slot].double().repeat_interleave(hq // hkv, dim=1)
        tok = int(meta["row_tok_off"][r])
        s = torch.einsum("hd,nhd->hn", q[tok].cpu().double(), k) / d**0.5
        out[tok] = torch.einsum("hn,nhd->hd", s.softmax(dim=1), v)
    return out


def run(q, kc, vc, meta, block_size, **kw):
    sentinel = torch.full_like(q, 7.0)
    return paged_decode_attention(q, kc, vc, **meta, block_size=block_size, out=sentinel, **kw)


def check_against_reference(got, q, kc, vc, meta, block_size, dtype):
    ref = reference(q, kc, vc, meta, block_size)
    for tok, expect in ref.items():
        torch.testing.assert_close(got[tok].cpu().double(), expect, **TOL[dtype])
    # Tokens of no row (padding rows, spare tokens) are never written.
    untouched = [t for t in range(q.shape[0]) if t not in ref]
    assert len(untouched) >= 2 and bool((got[untouched] == 7.0).all())


@pytest.fixture
def nan_scratch():
    """torch.empty returns NaN-filled memory: unwritten scratch that the merge reads would show."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(was)


@pytest.mark.usefixtures("nan_scratch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_matches_reference_and_paged_attention(dtype, hq, hkv, block_size):
    q, kc, vc, meta = decode_case(CONTEXTS, block_size, hq, hkv, 32, dtype, seed=block_size + hq)
    got = run(q, kc, vc, meta, block_size, config={"NUM_SPLITS": 8, "BLOCK_N": 16})
    check_against_reference(got, q, kc, vc, meta, block_size, dtype)
    old = paged_attention(q, kc, vc, *meta.values(), block_size, 1, out=torch.full_like(q, 7.0))
    torch.testing.assert_close(got, old, **TOL[dtype])


@pytest.mark.parametrize(
    "config, hq, hkv, d",
    [
        ({"NUM_SPLITS": 1, "BLOCK_N": 16}, 4, 2, 32),  # a single launch, no merge
        ({"NUM_SPLITS": 16, "BLOCK_N": 32}, 2, 2, 32),  # most slices of most rows empty
        ({"NUM_SPLITS": 4, "BLOCK_N": 8}, 6, 2, 48),  # group 3 padded to 4, head_dim padded to 64
        (None, 16, 16, 128),  # the default config at Ouro's head shape
    ],
    ids=["one-split", "sixteen-splits", "gqa3-d48", "default-ouro-heads"],
)
@pytest.mark.usefixtures("nan_scratch")
def test_decode_split_counts_and_shapes(config, hq, hkv, d):
    contexts = [1, 0, 17, 100] if d < 128 else [1, 0, 70]
    q, kc, vc, meta = decode_case(contexts, 4, hq, hkv, d, torch.float32, seed=d + hq)
    got = run(q, kc, vc, meta, 4, config=config)
    check_against_reference(got, q, kc, vc, meta, 4, torch.float32)


def test_decode_reads_cache_through_layer_strides():
    # One layer of a [2, L, slots, Hkv, D] cache is a strided view: the kernel must honour it.
    q, kc, vc, meta = decode_case([5, 0, 40], 4, 4, 2, 16, torch.float32, seed=9)
    cache = torch.stack([torch.stack([kc * 3, kc]), torch.stack([vc - 1, vc])])
    got = run(q, cache[0, 1], cache[1, 1], meta, 4, config={"NUM_SPLITS": 4, "BLOCK_N": 8})
    check_against_reference(got, q, kc, vc, meta, 4, torch.float32)


def test_decode_config_depends_only_on_shapes():
    # Ouro decode: 8 to 16 splits of 16-wide tiles on two warps up to 16 rows (measured on the H200), then
    # tuning.SPLIT_KV_WIDE's by rows x KV heads (measured on an H100).
    assert decode_config(1, 16, 1, 128, 4096) == {"NUM_SPLITS": 16, "BLOCK_N": 16, "num_warps": 2}
    assert decode_config(8, 16, 1, 128, 4096)["NUM_SPLITS"] == 8
    assert decode_config(16, 16, 1, 128, 4096)["NUM_SPLITS"] == 8
    rows = (17, 32, 33, 64, 128, 256, 512)
    wide = {r: decode_config(r, 16, 1, 128, 4096)["NUM_SPLITS"] for r in rows}
    assert wide == {17: 2, 32: 2, 33: 1, 64: 1, 128: 4, 256: 2, 512: 2}
    # Never more splits than BLOCK_N tiles of the longest context.
    assert decode_config(1, 16, 1, 128, 32)["NUM_SPLITS"] == 2
    q, kc, vc, meta = decode_case([3], 4, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        run(q, kc, vc, meta, 4, config={"NUM_SPLITS": 3})


def test_backend_routes_decode_calls_to_the_split_kernel(monkeypatch):
    hq, hkv, d, bs = 4, 2, 16, 4
    q, kc, vc, meta = decode_case([9, 0, 30], bs, hq, hkv, d, torch.float32, seed=11, extra_tokens=0)
    cache = torch.stack([kc, vc])[:, None]
    attn = TritonPagedAttention(cache.clone(), bs)
    n = q.shape[0]
    # No K/V write (slot -1): the cache holds the reference's K/V already.
    slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=DEV)
    k_new, v_new = randn(n, hkv, d, seed=12), randn(n, hkv, d, seed=13)
    calls = []

    def spy(*args, **kw):
        calls.append(kw.get("config"))
        return paged_decode_attention(*args, **kw)

    monkeypatch.setattr(triton_attention, "paged_decode_attention", spy)
    monkeypatch.setattr(triton_attention, "paged_attention", None)  # a decode call must not reach it
    attn.batch = TritonBatch(slot_mapping, slot_mapping, *meta.values(), max_q_len=1)
    got = attn(0, q.clone(), k_new, v_new)
    assert len(calls) == 1
    check_expect = reference(q, kc, vc, meta, bs)
    for tok, expect in check_expect.items():
        torch.testing.assert_close(got[tok].cpu().double(), expect, **TOL[torch.float32])


# ---- the fused one-launch decode against rope_write_kv + paged_decode_attention ----

THETA = 10000.0
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def rope_case(contexts, block_size, hq, hkv, d, dtype, seed=0, no_write=()):
    """decode_case plus UNROTATED q, k, v (column views of one qkv output), slots, positions, cos/sin.

    Row r's token writes its K/V to its slot of position row_q_start[r], except rows in
    no_write (slot -1: K/V already in the cache). Tokens of no row have slot -1 and a junk
    position (the table is shorter: it is clamped).
    """
    q0, kc, vc, meta = decode_case(contexts, block_size, hq, hkv, d, dtype, seed=seed)
    n = q0.shape[0]
    qkv = randn(n, (hq + 2 * hkv) * d, dtype=dtype, seed=seed + 4)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=1)
    slots = torch.full((n,), -1, dtype=torch.int64)
    positions = torch.full((n,), 10**6, dtype=torch.int64)
    tables = meta["block_tables"].cpu()
    for r in range(tables.shape[0]):
        if meta["row_len"][r] == 0:
            continue
        tok, pos = int(meta["row_tok_off"][r]), int(meta["row_q_start"][r])
        positions[tok] = pos
        if r not in no_write:
            slots[tok] = int(tables[r, pos // block_size]) * block_size + pos % block_size
    cos_sin = rope_cos_sin_table(max(contexts) + 8, d, THETA, DEV)
    return dict(
        q=q.view(n, hq, d), k=k.view(n, hkv, d), v=v.view(n, hkv, d), k_cache=kc, v_cache=vc,
        slot_mapping=slots.to(DEV), positions=positions.to(DEV), cos_sin=cos_sin, **meta,
    )  # fmt: skip


def three_launches(case, block_size, config):
    """(out, q rotated, k_cache, v_cache) of rope_write_kv then paged_decode_attention, on cache copies."""
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    q_rot = rope_write_kv(case["q"], case["k"], case["v"], kc, vc, case["slot_mapping"], case["positions"],
                          case["cos_sin"])  # fmt: skip
    meta = {key: case[key] for key in ("block_tables", "row_q_start", "row_len", "row_tok_off")}
    sentinel = torch.full_like(q_rot, 7.0)
    out = paged_decode_attention(q_rot, kc, vc, **meta, block_size=block_size, out=sentinel, config=config)
    return out, q_rot, kc, vc, meta


def fused(case, block_size, config):
    """(out, k_cache, v_cache) of fused_decode_attention on cache copies; q, k, v must stay as they were."""
    inputs = [case[key].clone() for key in ("q", "k", "v")]
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    out = torch.full(case["q"].shape[-3:], 7.0, dtype=kc.dtype, device=kc.device)
    got = fused_decode_attention(**{**case, "k_cache": kc, "v_cache": vc}, block_size=block_size, out=out,
                                 config=config)  # fmt: skip
    assert got is out
    for before, key in zip(inputs, ("q", "k", "v")):
        assert_same_bits(case[key], before)
    return got, kc, vc


def assert_same_bits(got, expect):
    ints = INT_VIEW[expect.dtype]
    assert got.dtype == expect.dtype and got.shape == expect.shape
    assert torch.equal(got.contiguous().view(ints), expect.contiguous().view(ints))


def check_fused(case, block_size, config, dtype):
    got, kc, vc = fused(case, block_size, config)
    expect, q_rot, kc_ref, vc_ref, meta = three_launches(case, block_size, config)
    assert_same_bits(got, expect)
    assert_same_bits(kc, kc_ref)
    assert_same_bits(vc, vc_ref)
    # Also right, not only equal: against float64 attention over the rotated q and the written cache.
    check_against_reference(got, q_rot, kc, vc, meta, block_size, dtype)
    return kc


@pytest.mark.usefixtures("nan_scratch")
@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_decode_equals_three_launches(dtype, hq, hkv, splits):
    # Rows 1 and 5 (contexts 15 and 100) carry slot -1: no write, their own K/V read from the cache.
    case = rope_case(CONTEXTS, 4, hq, hkv, 32, dtype, seed=hq + splits, no_write=(1, 5))
    kc = check_fused(case, 4, {"NUM_SPLITS": splits, "BLOCK_N": 16}, dtype)
    written = case["slot_mapping"] >= 0
    assert int(written.sum()) == 4
    assert bool((kc[case["slot_mapping"][written]] != case["k_cache"][case["slot_mapping"][written]]).any())


@pytest.mark.parametrize(
    "config, hq, hkv, d, dtype",
    [
        ({"NUM_SPLITS": 4, "BLOCK_N": 8}, 6, 2, 48, torch.float16),  # group 3 padded to 4, d 48 to 64
        (None, 16, 16, 128, torch.bfloat16),  # the default config at Ouro's head shape
    ],
    ids=["gqa3-d48-fp16", "default-ouro-heads-bf16"],
)
@pytest.mark.usefixtures("nan_scratch")
def test_fused_decode_shapes(config, hq, hkv, d, dtype):
    contexts = [1, 0, 17, 100] if d < 128 else [1, 0, 70]
    case = rope_case(contexts, 4, hq, hkv, d, dtype, seed=d)
    check_fused(case, 4, config, dtype)


@pytest.mark.usefixtures("nan_scratch")
def test_fused_decode_resets_its_counters():
    # Two calls of one shape share the counters: the second is right only if the first left them at 0.
    for seed in (1, 2):
        case = rope_case(CONTEXTS, 4, 4, 2, 16, torch.float32, seed=seed, no_write=(3,))
        check_fused(case, 4, {"NUM_SPLITS": 8, "BLOCK_N": 8}, torch.float32)
        counters = decode_attention._COUNTERS[case["q"].device]
        assert len(counters) == 1 and not counters[0].any()


@pytest.mark.usefixtures("nan_scratch")
@pytest.mark.parametrize("splits", [1, 4])
def test_fused_decode_takes_the_qkv_matmuls_partial_products(splits):
    # tc_linear(partial=True) hands out fp32 slots [S, N, W] (the last zero-filled where a group has fewer
    # contributors): the kernel adds them in slot order and rounds to bf16, as the matmul would have.
    hq, hkv, d, bs, n_slots = 4, 2, 16, 4, 3
    case = rope_case(CONTEXTS, bs, hq, hkv, d, torch.bfloat16, seed=31, no_write=(2,))
    n, width = case["q"].shape[0], (hq + 2 * hkv) * d
    slots = randn(n_slots, n, width, dtype=torch.float32, seed=32)
    slots[2, :, : width // 2] = 0.0
    total = slots[0].clone()
    for s in range(1, n_slots):
        total += slots[s]  # in slot order, as the kernel adds them
    qkv = total.to(torch.bfloat16)
    split = (hq * d, hkv * d, hkv * d)
    q, k, v = qkv.split(split, dim=1)
    summed = {**case, "q": q.view(n, hq, d), "k": k.view(n, hkv, d), "v": v.view(n, hkv, d)}
    pq, pk, pv = slots.split(split, dim=2)
    partial = {**case, "q": pq.view(n_slots, n, hq, d), "k": pk.view(n_slots, n, hkv, d),
               "v": pv.view(n_slots, n, hkv, d)}  # fmt: skip
    config = {"NUM_SPLITS": splits, "BLOCK_N": 16}
    got, kc, vc = fused(partial, bs, config)
    expect, kc_ref, vc_ref = fused(summed, bs, config)
    assert got.dtype == torch.bfloat16
    assert_same_bits(got, expect)
    assert_same_bits(kc, kc_ref)
    assert_same_bits(vc, vc_ref)
    with pytest.raises(ValueError, match="views of one partial output"):
        fused({**partial, "v": pv[:2].reshape(2, n, hkv, d)}, bs, config)


@pytest.mark.usefixtures("nan_scratch")
@pytest.mark.parametrize("early", [False, True], ids=["after-wait", "before-wait"])
@pytest.mark.parametrize("splits", [1, 4])
def test_fused_decode_loads_its_first_tile_before_the_wait_bit_for_bit(monkeypatch, early, splits):
    # An early launch loads the metadata and each slice's first K/V tile before its PDL wait (forced here,
    # also where no PDL runs): the same bits as the three launches. Contexts up to 100 at 16-wide tiles
    # also run the tiles after the first.
    monkeypatch.setattr(decode_attention, "pdl_launch_ok", lambda device, row_heads: early)
    case = rope_case(CONTEXTS, 4, 4, 2, 32, torch.bfloat16, seed=41 + splits, no_write=(1,))
    check_fused(case, 4, {"NUM_SPLITS": splits, "BLOCK_N": 16}, torch.bfloat16)


def test_fused_decode_caps_registers_at_few_rows(monkeypatch):
    # The cap is a GPU compile option: up to tuning's row count, never above it nor under the interpreter.
    fd = decode_attention
    monkeypatch.setattr(fd, "interpreting", lambda: False)
    cap = {"maxnreg": DECODE_ATTN_MAXNREG}
    assert fd.maxnreg(1) == fd.maxnreg(DECODE_ATTN_MAXNREG_ROWS) == cap
    assert fd.maxnreg(DECODE_ATTN_MAXNREG_ROWS + 1) == fd.maxnreg(16) == {}
    monkeypatch.setattr(fd, "interpreting", lambda: True)
    assert fd.maxnreg(1) == {}


@pytest.mark.skipif(DEV == "cpu", reason="a register cap is a GPU compile option")
@pytest.mark.usefixtures("nan_scratch")
@pytest.mark.parametrize("regs", [None, 0, 96], ids=["default", "uncapped", "cap96"])
@pytest.mark.parametrize("contexts", [[70], [1, 70]], ids=["1row", "2rows"])
def test_fused_decode_capped_registers_bit_for_bit(monkeypatch, regs, contexts):
    # Ouro's heads at 1 and 2 rows with the default config: capped or not, the three launches' bits.
    if regs is not None:
        monkeypatch.setattr(decode_attention, "maxnreg", lambda rows: {"maxnreg": regs} if regs else {})
    case = rope_case(contexts, 16, 16, 16, 128, torch.bfloat16, seed=7 + len(contexts))
    check_fused(case, 16, None, torch.bfloat16)


def test_fused_decode_launches_early_only_with_pdl_and_a_small_grid():
    # Off CUDA (or before Hopper) there is no PDL: never the attribute, whatever the grid. With PDL, the
    # attribute (and the early loads) only while rows x KV heads fit twice the SMs.
    if DEV == "cpu":
        assert not decode_attention.pdl_launch_ok(torch.device("cpu"), 1)
    else:
        dev = torch.device(DEV)
        assert decode_attention.pdl_launch_ok(dev, 1) == decode_attention.pdl_enabled(dev)
        assert not decode_attention.pdl_launch_ok(dev, 10**6)


def test_fused_decode_rejects_bad_inputs():
    case = rope_case([3], 4, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        fused(case, 4, {"NUM_SPLITS": 3})
    with pytest.raises(ValueError, match="cos_sin"):
        fused({**case, "cos_sin": case["cos_sin"].double()}, 4, None)
    with pytest.raises(ValueError, match="k and v"):
        fused({**case, "v": case["v"][:, :1]}, 4, None)


def rope_backend(case, block_size, layer=1):
    """A two-layer TritonPagedAttention with RoPE whose layer `layer` holds the case's cache."""
    cache = torch.stack([case["k_cache"], case["v_cache"]])[:, None].repeat(1, 2, 1, 1, 1)
    cache[:, 1 - layer] = 0
    attn = TritonPagedAttention(cache, block_size, THETA, max_positions=case["cos_sin"].shape[0])
    assert torch.equal(attn.cos_sin, case["cos_sin"])
    return attn


def test_backend_takes_partial_products_only_in_fused_decode_calls():
    hq, hkv, d, bs = 4, 2, 16, 4
    case = rope_case([9, 30], bs, hq, hkv, d, torch.float32, seed=22)
    meta = [case[key] for key in ("block_tables", "row_q_start", "row_len", "row_tok_off")]
    attn = rope_backend(case, bs)
    attn.batch = TritonBatch(case["slot_mapping"], case["positions"], *meta, max_q_len=1)
    assert attn.takes_partials()
    attn.batch = TritonBatch(case["slot_mapping"], case["positions"], *meta, max_q_len=2)
    assert not attn.takes_partials()
    slots = [case[key][None].repeat(2, 1, 1, 1) for key in ("q", "k", "v")]
    with pytest.raises(ValueError, match="takes_partials"):
        attn(1, *slots)


def test_backend_routes_rope_decode_calls_to_the_fused_kernel(monkeypatch):
    hq, hkv, d, bs = 4, 2, 16, 4
    case = rope_case([9, 0, 30, 1], bs, hq, hkv, d, torch.float32, seed=21, no_write=(3,))
    expect, _, kc_ref, vc_ref, meta = three_launches(case, bs, None)
    attn = rope_backend(case, bs)
    calls = []

    def spy(*args, **kw):
        calls.append(args)
        return fused_decode_attention(*args, **kw)

    monkeypatch.setattr(triton_attention, "fused_decode_attention", spy)
    for name in ("rope_write_kv", "paged_decode_attention", "paged_attention"):
        monkeypatch.setattr(triton_attention, name, None)  # a decode call with RoPE must reach none of them
    attn.batch = TritonBatch(case["slot_mapping"], case["positions"], *meta.values(), max_q_len=1)
    got = attn(1, case["q"], case["k"], case["v"])
    assert len(calls) == 1
    rows = meta["row_tok_off"][meta["row_len"] > 0].long()
    assert_same_bits(got[rows], expect[rows])
    # The layer's cache views are strided: the kernel wrote through them, and left layer 0 alone.
    assert_same_bits(attn.kv_cache[0, 1], kc_ref)
    assert_same_bits(attn.kv_cache[1, 1], vc_ref)
    assert not attn.kv_cache[:, 0].any()


def test_backend_keeps_prefill_calls_on_the_three_kernel_path(monkeypatch):
    hq, hkv, d, bs = 4, 2, 16, 4
    case = rope_case([9, 0, 30], bs, hq, hkv, d, torch.float32, seed=23)
    expect, _, kc_ref, _, meta = three_launches(case, bs, None)
    attn = rope_backend(case, bs)
    monkeypatch.setattr(triton_attention, "fused_decode_attention", None)  # a prefill call must not reach it
    # The same single-token rows under a prefill bound (max_q_len 2) take rope_write_kv + paged_attention.
    attn.batch = TritonBatch(case["slot_mapping"], case["positions"], *meta.values(), max_q_len=2)
    got = attn(1, case["q"].clone(), case["k"], case["v"])
    rows = meta["row_tok_off"][meta["row_len"] > 0].long()
    torch.testing.assert_close(got[rows], expect[rows], **TOL[torch.float32])
    assert_same_bits(attn.kv_cache[0, 1], kc_ref)
