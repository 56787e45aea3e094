"""Split-KV decode attention against a plain PyTorch reference and against paged_attention."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: the interpreter runs the kernels with numpy.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (the `gpu` extra: pip install 'triton>=3.0')")

from ouro_fast.kernels import paged_attention, paged_decode_attention  # noqa: E402
from ouro_fast.kernels.decode_attention import decode_config  # noqa: E402
from ouro_fast.model import triton_attention  # noqa: E402
from ouro_fast.model.triton_attention import TritonBatch, TritonPagedAttention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: one rounding of the output (either side of a tie can round differently).
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}
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
    # Ouro decode: 8 to 16 splits of 16-wide tiles on two warps (measured on the H200).
    assert decode_config(1, 16, 1, 128, 4096) == {"NUM_SPLITS": 16, "BLOCK_N": 16, "num_warps": 2}
    assert decode_config(8, 16, 1, 128, 4096)["NUM_SPLITS"] == 8
    assert decode_config(64, 16, 1, 128, 4096)["NUM_SPLITS"] == 8
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
