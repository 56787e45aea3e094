"""Shared-prefix (cascade) decode attention: the one-launch decode with rows grouped by a shared prefix
against the same call without groups (itself tested bit for bit against the three-launch reference)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: the interpreter runs the kernels with numpy.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (the `gpu` extra: pip install 'triton>=3.0')")

from ouro_fast.kernels import fused_decode_attention, paged_attention, rope_cos_sin_table  # noqa: E402
from ouro_fast.kernels.cascade_attention import SharedPrefixes, prefix_config  # noqa: E402
from ouro_fast.kernels.launch import interpreting  # noqa: E402
from ouro_fast.kernels.tuning import CASCADE_SPLITS, INTERPRETER_MAX_SPLITS  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BS = 4
# fp32: the sums' order differs; bf16: one rounding of the output either way.
TOL = {torch.float32: {"atol": 2e-6, "rtol": 2e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def shared_case(groups, extras, hq, hkv, d, dtype, seed=0, lens=None):
    """Rows with shared leading blocks: groups[r] is row r's group (-1: none), extras[r] its positions past
    the group's prefix (0: a padding row), lens[r] its query tokens (default 1), the last at its last
    position. Group g's prefix is 3 + 2g blocks, in shuffled blocks."""
    prefix_blocks = {g: 3 + 2 * g for g in set(groups) if g >= 0}
    r = len(groups)
    own = [-(-e // BS) + 1 for e in extras]
    total = sum(prefix_blocks.values()) + sum(own) + 2
    perm = torch.randperm(total, generator=gen(seed)).tolist()
    shared = {g: [perm.pop() for _ in range(n)] for g, n in prefix_blocks.items()}
    mb = max(prefix_blocks.values(), default=0) + max(own)
    tables = torch.full((r, mb), -1, dtype=torch.int32)
    lens = [int(e > 0) * (1 if lens is None else lens[i]) for i, e in enumerate(extras)]
    q_start = []
    for i, (g, e) in enumerate(zip(groups, extras)):
        blocks = shared.get(g, []) + [perm.pop() for _ in range(own[i])]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        q_start.append(prefix_blocks.get(g, 0) * BS + max(e, 1) - max(lens[i], 1))
    n = sum(lens) + 1
    tok_off = [sum(lens[i + 1 :]) for i in range(r)]  # tokens in reverse row order
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen(seed + 1)).to(dtype).to(DEV)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=1)
    slots = total * BS
    kc = torch.randn(slots, hkv, d, generator=gen(seed + 2)).to(dtype).to(DEV)
    vc = torch.randn(slots, hkv, d, generator=gen(seed + 3)).to(dtype).to(DEV)
    slot_mapping = torch.full((n,), -1, dtype=torch.int64)
    positions = torch.zeros(n, dtype=torch.int64)
    for i in range(r):
        for j in range(lens[i]):
            tok, pos = tok_off[i] + j, q_start[i] + j
            positions[tok] = pos
            slot_mapping[tok] = int(tables[i, pos // BS]) * BS + pos % BS
    case = dict(
        q=q.view(n, hq, d), k=k.view(n, hkv, d), v=v.view(n, hkv, d), k_cache=kc, v_cache=vc,
        slot_mapping=slot_mapping.to(DEV), positions=positions.to(DEV),
        cos_sin=rope_cos_sin_table(mb * BS + 4, d, 10000.0, DEV), block_tables=tables.to(DEV),
        row_q_start=torch.tensor(q_start, dtype=torch.int32, device=DEV),
        row_len=torch.tensor(lens, dtype=torch.int32, device=DEV),
        row_tok_off=torch.tensor(tok_off, dtype=torch.int32, device=DEV),
    )  # fmt: skip
    group_len = [prefix_blocks.get(g, 0) * BS for g in range(max(groups) + 2)]  # one unused group
    as_int32 = dict(dtype=torch.int32, device=DEV)
    prefixes = SharedPrefixes(torch.tensor(groups, **as_int32), torch.tensor(group_len, **as_int32))
    return case, prefixes


def run(case, config, prefixes=None, prefix_config=None):
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    out = torch.full(case["q"].shape[-3:], 7.0, dtype=kc.dtype, device=kc.device)
    fused_decode_attention(**{**case, "k_cache": kc, "v_cache": vc}, block_size=BS, out=out, config=config,
                           prefixes=prefixes, prefix_config=prefix_config)  # fmt: skip
    return out, kc, vc


def check(case, prefixes, config, prefix_cfg, dtype):
    got, kc, vc = run(case, config, prefixes, prefix_cfg)
    expect, kc_ref, vc_ref = run(case, config)
    for cache, ref in ((kc, kc_ref), (vc, vc_ref)):  # the same K/V writes
        torch.testing.assert_close(cache, ref, rtol=0, atol=0, equal_nan=True)
    rows = case["row_len"] > 0
    toks = case["row_tok_off"][rows].long()
    torch.testing.assert_close(got[toks].float(), expect[toks].float(), **TOL[dtype])
    others = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    others[toks] = False
    assert bool((got[others] == 7.0).all())  # tokens of no row untouched
    return got, expect


@pytest.mark.parametrize("pre_splits", [1, 2, 4])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_rows_match_the_ungrouped_decode(dtype, hq, hkv, splits, pre_splits):
    # Group 0: rows 0, 2, 5 (5 a padding row); group 1: rows 1 and 4; row 3 in none.
    groups = [0, 1, 0, -1, 1, 0]
    extras = [1, 9, 30, 7, 4, 0]
    case, prefixes = shared_case(groups, extras, hq, hkv, 32, dtype, seed=hq + splits + pre_splits)
    check(case, prefixes, {"NUM_SPLITS": splits, "BLOCK_N": 16},
          {"PRE_SPLITS": pre_splits, "BLOCK_N": 16, "BLOCK_R": 16}, dtype)  # fmt: skip


def test_groups_over_several_row_chunks_and_unused_groups():
    # 20 rows in chunks of 16: group 1's members sit in both chunks; group 2 has no member, group 3 a
    # prefix of 0 (no cascade for its rows).
    groups = [1, 0, 1, -1] * 5
    groups[7] = 3
    extras = [1 + (3 * i) % 11 for i in range(20)]
    case, prefixes = shared_case(groups, extras, 2, 2, 16, torch.float32, seed=5)
    prefixes.group_len[2], prefixes.group_len[3] = 8, 0
    check(case, prefixes, {"NUM_SPLITS": 2, "BLOCK_N": 8}, {"PRE_SPLITS": 2, "BLOCK_N": 16, "BLOCK_R": 16},
          torch.float32)  # fmt: skip


def test_a_group_does_not_read_rows_beyond_its_prefix():
    # Poison every cache slot outside the prefixes and the rows' own blocks: results stay finite and equal.
    groups, extras = [0, 0, 0], [2, 5, 13]
    case, prefixes = shared_case(groups, extras, 2, 2, 16, torch.float32, seed=9)
    used = case["block_tables"][case["block_tables"] >= 0].long().unique()
    poison = torch.ones(case["k_cache"].shape[0] // BS, dtype=torch.bool, device=DEV)
    poison[used] = False
    for cache in (case["k_cache"], case["v_cache"]):
        cache.view(-1, BS, *cache.shape[1:])[poison] = float("nan")
    cfg, pcfg = {"NUM_SPLITS": 2, "BLOCK_N": 8}, {"PRE_SPLITS": 4, "BLOCK_N": 16}
    got, _ = check(case, prefixes, cfg, pcfg, torch.float32)
    assert bool(torch.isfinite(got).all())


def test_the_qkv_matmuls_partial_products_enter_as_in_the_ungrouped_decode():
    hq, hkv, d, n_slots = 2, 2, 16, 3
    case, prefixes = shared_case([0, 0, -1, 0], [3, 6, 2, 1], hq, hkv, d, torch.bfloat16, seed=13)
    n, width = case["q"].shape[0], (hq + 2 * hkv) * d
    slots = torch.randn(n_slots, n, width, generator=gen(14)).to(DEV)
    total = slots[0] + slots[1] + slots[2]
    q, k, v = total.to(torch.bfloat16).split((hq * d, hkv * d, hkv * d), dim=1)
    summed = {**case, "q": q.view(n, hq, d), "k": k.view(n, hkv, d), "v": v.view(n, hkv, d)}
    pq, pk, pv = slots.split((hq * d, hkv * d, hkv * d), dim=2)
    partial = {**case, "q": pq.view(n_slots, n, hq, d), "k": pk.view(n_slots, n, hkv, d),
               "v": pv.view(n_slots, n, hkv, d)}  # fmt: skip
    cfg, pcfg = {"NUM_SPLITS": 2, "BLOCK_N": 8}, {"PRE_SPLITS": 2, "BLOCK_N": 16}
    got, _, _ = run(partial, cfg, prefixes, pcfg)
    expect, _, _ = run(summed, cfg, prefixes, pcfg)
    assert torch.equal(got, expect)


def test_prefix_config_is_a_function_of_shapes():
    assert prefix_config(8, 4096) == prefix_config(8, 4096)
    assert prefix_config(1, 4096)["BLOCK_R"] == 16
    assert prefix_config(200, 4096)["BLOCK_R"] == 64
    assert prefix_config(8, 16)["PRE_SPLITS"] == 1
    most = INTERPRETER_MAX_SPLITS if interpreting() else CASCADE_SPLITS
    assert prefix_config(8, 4096)["PRE_SPLITS"] == most


def test_bad_groups_are_refused():
    case, prefixes = shared_case([0, 0], [1, 2], 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        run(case, None, SharedPrefixes(prefixes.row_group.long(), prefixes.group_len))
    with pytest.raises(ValueError, match="cover"):
        run(case, None, SharedPrefixes(prefixes.row_group[:1], prefixes.group_len))
    out = torch.zeros(2, *case["q"].shape, dtype=case["k_cache"].dtype, device=DEV)  # an extra dimension
    with pytest.raises(ValueError, match="out must be"):
        fused_decode_attention(**case, block_size=BS, out=out)


@pytest.mark.parametrize("pre_splits", [1, 4])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_token_rows_of_a_mixed_batch_read_their_group_prefix_once(dtype, hq, hkv, pre_splits):
    # A step with prompt chunks (rows 3 and 4, three tokens each; row 4 in group 0, which a row of more
    # than one token ignores) beside grouped one-token rows: paged_attention with the groups against
    # paged_attention without them, on the same rotated q and cache.
    groups, extras, lens = [0, 1, 0, -1, 0, 1], [1, 9, 30, 7, 5, 3], [1, 1, 1, 3, 3, 1]
    case, prefixes = shared_case(groups, extras, hq, hkv, 32, dtype, seed=hq + pre_splits, lens=lens)
    meta = {key: case[key] for key in ("block_tables", "row_q_start", "row_len", "row_tok_off")}
    q, kc, vc = case["q"], case["k_cache"], case["v_cache"]
    pcfg = {"PRE_SPLITS": pre_splits, "BLOCK_N": 16, "BLOCK_R": 16}
    got = paged_attention(q, kc, vc, **meta, block_size=BS, max_q_len=4, prefixes=prefixes,
                          prefix_config=pcfg)  # fmt: skip
    expect = paged_attention(q, kc, vc, **meta, block_size=BS, max_q_len=4)
    toks = torch.cat([torch.arange(o, o + n) for o, n in zip(case["row_tok_off"].tolist(), lens)])
    torch.testing.assert_close(got[toks].float(), expect[toks].float(), **TOL[dtype])


@pytest.mark.parametrize("path", ["decode", "mixed"])
def test_a_member_reads_the_prefix_through_the_group_not_its_own_table(path):
    # Rows 1 and 2 of group 0 get prefix entries of their own that point at a block of other values: with
    # the groups their results stay those of the intact tables (the prefix came through row 0's), without
    # them they change.
    groups, extras = [0, 0, 0, -1], [2, 5, 9, 4]
    lens = [1, 1, 1, 2] if path == "mixed" else None
    case, prefixes = shared_case(groups, extras, 2, 2, 16, torch.float32, seed=21, lens=lens)
    prefix_blocks = int(prefixes.group_len[0]) // BS
    used = set(case["block_tables"][case["block_tables"] >= 0].tolist())
    spare = min(set(range(case["k_cache"].shape[0] // BS)) - used)  # a block no table holds
    poisoned = {**case, "block_tables": case["block_tables"].clone()}
    poisoned["block_tables"][1:3, :prefix_blocks] = spare
    for key, value in (("k_cache", 0.0), ("v_cache", 100.0)):  # keys of weight ~1, values far off
        poisoned[key] = case[key].clone()
        poisoned[key].view(-1, BS, *case[key].shape[1:])[spare] = value
    pcfg = {"PRE_SPLITS": 2, "BLOCK_N": 16}
    if path == "decode":
        expect, _, _ = run(case, {"NUM_SPLITS": 2, "BLOCK_N": 8})
        got, _, _ = run(poisoned, {"NUM_SPLITS": 2, "BLOCK_N": 8}, prefixes, pcfg)
        ungrouped, _, _ = run(poisoned, {"NUM_SPLITS": 2, "BLOCK_N": 8})
    else:
        keys = ("block_tables", "row_q_start", "row_len", "row_tok_off")

        def attend(c, **kw):
            tensors = {k: c[k] for k in keys}
            return paged_attention(
                c["q"], c["k_cache"], c["v_cache"], **tensors, block_size=BS, max_q_len=2, **kw
            )

        expect, got = attend(case), attend(poisoned, prefixes=prefixes, prefix_config=pcfg)
        ungrouped = attend(poisoned)
    toks = case["row_tok_off"][:3].long()
    torch.testing.assert_close(got[toks], expect[toks], **TOL[torch.float32])
    assert all(float((ungrouped[t] - expect[t]).abs().max()) > 1.0 for t in toks[1:])
