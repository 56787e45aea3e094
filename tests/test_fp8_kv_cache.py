"""A float8 e4m3 K/V cache (kv_cache_dtype "fp8"): the values it holds, bit for bit against torch's
rounding, and every kernel that writes or reads it against the same kernel over the cache widened
back to the activations' dtype (or against the three-launch decode, itself tested against float64)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: the interpreter runs the kernels with numpy.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (the `gpu` extra: pip install 'triton>=3.0')")

from ouro_fast.engine.engine import Engine, EngineConfig  # noqa: E402
from ouro_fast.engine.sampling import SamplingParams  # noqa: E402
from ouro_fast.kernels import (  # noqa: E402
    fused_decode_attention,
    paged_attention,
    paged_decode_attention,
    propagate_kv,
    rope_cos_sin_table,
    rope_write_kv,
)
from ouro_fast.kernels.tuning import DECODE_ATTN_FP8_TO_FP32_ROWS  # noqa: E402
from ouro_fast.model.attention import to_cache_dtype  # noqa: E402
from ouro_fast.server.config import ConfigError, ServerConfig  # noqa: E402
from tests.test_cascade_attention import shared_case  # noqa: E402
from tests.test_decode_attention import decode_case, rope_case  # noqa: E402
from tests.test_gpu_runner import generate  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
META = ("block_tables", "row_q_start", "row_len", "row_tok_off")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int16)


def assert_same_bits(got: torch.Tensor, expect: torch.Tensor) -> None:
    assert got.dtype == expect.dtype and got.shape == expect.shape
    assert torch.equal(bits(got), bits(expect))


def fp8_case(case: dict) -> dict:
    """The case with its caches held in FP8 (as to_cache_dtype rounds them)."""
    kc, vc = to_cache_dtype(case["k_cache"], FP8), to_cache_dtype(case["v_cache"], FP8)
    return {**case, "k_cache": kc, "v_cache": vc}


def test_the_reference_rounding_saturates_and_keeps_signed_zeros():
    x = torch.tensor([448.0, 464.0, -1000.0, 31.0, 29.0, 0.0, -0.0, -1e-6, 1e-3], dtype=torch.bfloat16)
    got = to_cache_dtype(x, FP8)
    assert got.float().tolist()[:5] == [448.0, 448.0, -448.0, 32.0, 28.0]  # ties to even
    assert bits(got).tolist()[5:8] == [0x00, 0x80, 0x80]  # +0, -0, and a negative that rounds to -0
    assert torch.equal(to_cache_dtype(x, torch.bfloat16), x)  # any other dtype: a plain cast


@pytest.mark.parametrize("rope", [False, True], ids=["copy", "rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_write_kv_stores_what_the_activation_cache_holds_rounded_to_fp8(dtype, rope):
    n, hq, hkv, d = 6, 4, 2, 32
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(n, hq, d, generator=gen).to(dtype).to(DEV)
    # Values past +-448, ties of e4m3 and values below its subnormals.
    k = (torch.randn(n, hkv, d, generator=gen) * 200).to(dtype).to(DEV)
    v = (torch.randn(n, hkv, d, generator=gen) * 300).to(dtype).to(DEV)
    v[0, 0, :4] = torch.tensor([31.0, 29.0, -1e-4, 5e-3])
    slot_mapping = torch.tensor([3, 0, -1, 12, 7, 9], device=DEV)
    positions = torch.arange(5, 5 + n, device=DEV) if rope else None
    table = rope_cos_sin_table(32, d, 10000.0, DEV) if rope else None
    wide = [torch.zeros(16, hkv, d, dtype=dtype, device=DEV) for _ in range(2)]
    narrow = [torch.zeros(16, hkv, d, dtype=FP8, device=DEV) for _ in range(2)]
    q_wide = rope_write_kv(q, k, v, *wide, slot_mapping, positions, table)
    q_narrow = rope_write_kv(q, k, v, *narrow, slot_mapping, positions, table)
    assert_same_bits(q_narrow, q_wide)  # q stays in the activations' dtype
    for got, ref in zip(narrow, wide):
        assert_same_bits(got, to_cache_dtype(ref, FP8))
    assert bool((narrow[1].float().abs().max() == 448.0).item())  # saturated, not inf or NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_and_split_decode_read_an_fp8_cache_as_its_widened_values(dtype):
    q, kc, vc, meta = decode_case([1, 15, 0, 17, 100], 4, 4, 2, 32, dtype, seed=4)
    kc8, vc8 = to_cache_dtype(kc * 4, FP8), to_cache_dtype(vc * 4, FP8)
    kw, vw = kc8.to(dtype), vc8.to(dtype)
    for max_q_len in (1, 3):
        got = paged_attention(q, kc8, vc8, *meta.values(), 4, max_q_len, out=torch.full_like(q, 7.0))
        expect = paged_attention(q, kw, vw, *meta.values(), 4, max_q_len, out=torch.full_like(q, 7.0))
        assert_same_bits(got, expect)
    cfg = {"NUM_SPLITS": 4, "BLOCK_N": 8}
    got = paged_decode_attention(q, kc8, vc8, **meta, block_size=4, out=torch.full_like(q, 7.0), config=cfg)
    expect = paged_decode_attention(q, kw, vw, **meta, block_size=4, out=torch.full_like(q, 7.0), config=cfg)
    assert_same_bits(got, expect)
    with pytest.raises(ValueError, match="k_cache must be"):
        paged_attention(q, kc8.to(torch.float16), vc8, *meta.values(), 4, 1)
    with pytest.raises(ValueError, match="dtypes must match"):
        paged_attention(q, kc8, kw, *meta.values(), 4, 1)


def three_launches_fp8(case, bs, config):
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    q_rot = rope_write_kv(case["q"], case["k"], case["v"], kc, vc, case["slot_mapping"], case["positions"],
                          case["cos_sin"])  # fmt: skip
    out = paged_decode_attention(q_rot, kc, vc, **{m: case[m] for m in META}, block_size=bs,
                                 out=torch.full_like(q_rot, 7.0), config=config)  # fmt: skip
    return out, kc, vc


def fused_fp8(case, bs, config, out_dtype, **kw):
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    out = torch.full(case["q"].shape[-3:], 7.0, dtype=out_dtype, device=kc.device)
    fused_decode_attention(**{**case, "k_cache": kc, "v_cache": vc}, block_size=bs, out=out, config=config,
                           **kw)  # fmt: skip
    return out, kc, vc


# Up to tuning.DECODE_ATTN_FP8_TO_FP32_ROWS rows the fused kernel widens FP8 tiles to fp32, over it through
# fp16; the three launches' decode always through fp16.
ROW_LENS = {"6-rows": [1, 15, 0, 16, 17, 100], "12-rows": [1, 15, 0, 16, 17, 100, 3, 40, 9, 2, 33, 64]}


@pytest.mark.parametrize("rows", list(ROW_LENS))
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_decode_on_an_fp8_cache_equals_three_launches(dtype, splits, rows):
    # The fused kernel attends to its own K/V from registers: they must be the FP8 values the cache gets.
    assert (len(ROW_LENS[rows]) <= DECODE_ATTN_FP8_TO_FP32_ROWS) == (rows == "6-rows")
    case = fp8_case(rope_case(ROW_LENS[rows], 4, 4, 2, 32, dtype, seed=7 + splits, no_write=(1,)))
    config = {"NUM_SPLITS": splits, "BLOCK_N": 16}
    got, kc, vc = fused_fp8(case, 4, config, dtype)
    expect, kc_ref, vc_ref = three_launches_fp8(case, 4, config)
    assert_same_bits(got, expect)
    assert_same_bits(kc, kc_ref)
    assert_same_bits(vc, vc_ref)
    slots = case["slot_mapping"][case["slot_mapping"] >= 0]
    assert bool((bits(kc[slots]) != bits(case["k_cache"][slots])).any())  # the writes happened


def test_fused_decode_takes_partial_products_with_an_fp8_cache_given_the_activations_dtype():
    hq, hkv, d, bs = 4, 2, 16, 4
    case = fp8_case(rope_case([1, 15, 0, 17], bs, hq, hkv, d, torch.bfloat16, seed=31))
    n, width = case["q"].shape[0], (hq + 2 * hkv) * d
    slots = torch.randn(3, n, width, generator=torch.Generator().manual_seed(32)).to(DEV)
    total = slots[0] + slots[1] + slots[2]  # in slot order, as the kernel adds them
    split = (hq * d, hkv * d, hkv * d)
    q, k, v = total.to(torch.bfloat16).split(split, dim=1)
    summed = {**case, "q": q.view(n, hq, d), "k": k.view(n, hkv, d), "v": v.view(n, hkv, d)}
    pq, pk, pv = slots.split(split, dim=2)
    partial = {**case, "q": pq.view(3, n, hq, d), "k": pk.view(3, n, hkv, d), "v": pv.view(3, n, hkv, d)}
    config = {"NUM_SPLITS": 2, "BLOCK_N": 16}
    got, kc, vc = fused_fp8(partial, bs, config, torch.bfloat16, dtype=torch.bfloat16)
    expect, kc_ref, vc_ref = fused_fp8(summed, bs, config, torch.bfloat16)
    assert_same_bits(got, expect)
    assert_same_bits(kc, kc_ref)
    assert_same_bits(vc, vc_ref)
    with pytest.raises(ValueError, match="need dtype"):
        fused_decode_attention(**partial, block_size=bs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_prefix_rows_read_an_fp8_prefix_as_the_ungrouped_decode_does(dtype):
    groups, extras = [0, 1, 0, -1, 1, 0], [1, 9, 30, 7, 4, 0]
    case, prefixes = shared_case(groups, extras, 4, 2, 32, dtype, seed=9)
    case = fp8_case(case)
    config, pre = {"NUM_SPLITS": 2, "BLOCK_N": 16}, {"PRE_SPLITS": 2, "BLOCK_N": 16, "BLOCK_R": 16}
    got, kc, vc = fused_fp8(case, 4, config, dtype, prefixes=prefixes, prefix_config=pre)
    expect, kc_ref, vc_ref = fused_fp8(case, 4, config, dtype)
    assert_same_bits(kc, kc_ref)
    assert_same_bits(vc, vc_ref)
    toks = case["row_tok_off"][case["row_len"] > 0].long()
    tol = {"atol": 2e-6, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got[toks].float(), expect[toks].float(), **tol)


def test_propagate_kv_copies_fp8_bytes():
    cache = to_cache_dtype(torch.randn(2, 3, 32, 2, 16, generator=torch.Generator().manual_seed(5)) * 50, FP8)
    cache = cache.to(DEV)
    src, dst = torch.tensor([1, 4, 20], device=DEV), torch.tensor([2, 5, 21], device=DEV)
    ref = cache.clone()
    ref[:, :, dst] = ref[:, :, src]
    propagate_kv(cache, src, dst)
    assert_same_bits(cache, ref)


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_triton_runner_with_an_fp8_cache_matches_the_torch_runner_with_one(model_dir, threshold):
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=threshold, ignore_eos=True)
    opts = dict(model=model_dir, dtype="float32", max_num_batched_tokens=16, kv_cache_dtype="fp8")
    ref = Engine(EngineConfig(runner="torch", device="cpu", **opts))
    assert ref.runner.kv_cache.dtype == FP8
    want = generate(ref, params)
    engine = Engine(EngineConfig(runner="triton", **opts))
    assert engine.runner.kv_cache.dtype == FP8
    assert generate(engine, params) == want  # the runners' tokens and exit loops


def test_an_fp8_cache_holds_more_blocks_in_the_same_bytes(model_dir):
    opts = dict(model=model_dir, dtype="float32", runner="torch", device="cpu", kv_cache_bytes=8 << 20)
    wide, narrow = Engine(EngineConfig(**opts)), Engine(EngineConfig(kv_cache_dtype="fp8", **opts))
    assert narrow.block_bytes * 4 == wide.block_bytes
    assert narrow.scheduler.num_blocks == 4 * wide.scheduler.num_blocks
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        Engine(EngineConfig(kv_cache_dtype="fp4", **opts))


def test_the_server_option_is_checked_and_reaches_the_engine():
    config = ServerConfig.from_env({"OURO_FAST_KV_CACHE_DTYPE": "fp8"})
    assert config.engine_options()["kv_cache_dtype"] == "fp8"
    with pytest.raises(ConfigError, match="OURO_FAST_KV_CACHE_DTYPE must be auto or fp8"):
        ServerConfig.from_env({"OURO_FAST_KV_CACHE_DTYPE": "int8"})


COMPILE_WALK = """
import json, sys
sys.path[:0] = [ROOT, ROOT + "/tests"]
import torch
import offline_compile as oc
from ouro_fast.kernels.precompile import precompile

oc.install()
from ouro_fast.kernels import (fused_decode_attention, paged_attention, paged_decode_attention, propagate_kv,
                               rope_cos_sin_table, rope_write_kv)
from ouro_fast.kernels.cascade_attention import SharedPrefixes

def walk():
    i32, i64, bf = torch.int32, torch.int64, torch.bfloat16
    n, h, d, bs = 4, 16, 128, 16
    for cache in (bf, torch.float8_e4m3fn):
        q, k, v = (torch.zeros(n, h, d, dtype=bf) for _ in range(3))
        kc, vc = (torch.zeros(64, h, d, dtype=cache) for _ in range(2))
        meta = (torch.zeros(n, 4, dtype=i32), torch.zeros(n, dtype=i32), torch.ones(n, dtype=i32),
                torch.arange(n, dtype=i32))
        slots, pos = torch.arange(n, dtype=i64), torch.arange(n, dtype=i64)
        cos_sin = rope_cos_sin_table(64, d, 1e4)
        pre = SharedPrefixes(torch.zeros(n, dtype=i32), torch.tensor([16], dtype=i32))
        fused_decode_attention(q, k, v, kc, vc, slots, pos, cos_sin, *meta, bs)
        fused_decode_attention(q, k, v, kc, vc, slots, pos, cos_sin, *meta, bs, prefixes=pre)
        rope_write_kv(q, k, v, kc, vc, slots, pos, cos_sin)
        paged_decode_attention(q, kc, vc, *meta, bs)
        paged_attention(q, kc, vc, *meta, bs, 4)
        paged_attention(q, kc, vc, *meta, bs, 1, prefixes=pre)
        propagate_kv(torch.zeros(2, 2, 64, h, d, dtype=cache), slots, slots + 8)

print(json.dumps({"compiled": precompile(walk, threads=2)}))
"""


def test_every_kernel_on_the_cache_compiles_for_hopper_with_either_cache(tmp_path):
    # The interpreter runs the kernels as Python; this compiles them (ptxas included) for sm_90, where the
    # code generator refuses what the interpreter lets pass. bf16 and FP8 caches compile different variants.
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "walk.py"  # triton reads a kernel's source from its file
    script.write_text(f"ROOT = {str(root)!r}\n" + COMPILE_WALK)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    env.update(CUDA_VISIBLE_DEVICES="", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])["compiled"]
    assert compiled >= 14  # seven launches for each cache dtype, a distinct variant each (some two kernels)
