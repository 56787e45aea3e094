"""Every launch-tuning default of the kernels, with what it was chosen for.

Each value is chosen for speed; any value the kernels accept gives correct results. Register
caps, ring depth and pacing leave the bits as they are (tests check this on the GPU); a split
count or a tile length along a sum reorders that fp32 sum, so it may change the last bits.
Timings are of the Ouro-1.4B decode loop (bf16, CUDA graph) on one H200 unless said otherwise;
"1 / 8 rows" are two batch sizes of the same run.
"""

from __future__ import annotations

# ---- tensor-core matmul (tc_gemm) ----

# Rows (tokens) up to which matmuls run on tensor cores: the kernel's widest token tile; above, cuBLAS.
# H100, decode loop at context 160: 1.741 ms at 32 rows against 1.932 on cuBLAS; a 64-token tile measured
# 2.451 ms at 64 rows against cuBLAS's 2.443 (with 128-column tiles, deeper rings or 128 registers too).
TC_MAX_ROWS = 32
# The kernel's token tiles (the wgmma's N); a call takes the smallest that holds its rows.
TC_TOKEN_TILES = (8, 16, 32)
# Rows up to which down's SiLU-and-mul prologue runs in the kernel: it holds a tile's gate and up chunks
# in registers (wider calls take gate_up's SwiGLU epilogue, or cuBLAS).
TC_SILU_MUL_MAX_ROWS = 16
# K columns of a [64, TC] weight tile: one 32 KB TMA load in bf16, a wgmma of K 256.
TC_TILE_COLS = 256
# Most weight tiles in a CTA's ring (fewer where the shared-memory budget or the CTA's tiles are fewer).
TC_RING_SLOTS = 4
# CTAs per SM: two (112 KB each, the next matmul streaming beside this one) measured slower than one.
TC_CTAS_PER_SM = 1
# Shared memory a CTA may take: loop 0.911 / 1.026 ms at 1 / 8 rows against 0.917 / 1.037 at 225 KB.
TC_SMEM_BUDGET = 160 * 1024
# Per CTA where row groups outnumber the SMs (at most twice): a CTA per group, two a SM, no sums between
# CTAs; loop 1.014 / 1.125 ms at 1 / 8 rows against 1.072 / 1.172 with ranges of tiles.
TC_WHOLE_GROUP_SMEM = 113 * 1024
# Weight tiles a CTA may load before its PDL wait: more than any ring holds, so the whole ring fills.
TC_PREFETCH_TILES = 64
# Pace (x 500 ns between the first tiles, while the PDL wait lasts) of qkv, o_proj and gate_up, whose CTAs
# start beside a running kernel: loop 0.852 / 0.962 ms at 1 / 8 rows against 0.879 / 0.997 unpaced.
TC_PACE_BESIDE = 2
# Registers a thread, by token tile: 112 at 8 leaves room for the attention's and norms' CTAs beside the
# matmul's (loop at 4 / 8 rows 0.991 / 1.038 ms against 1.054 / 1.078 with 128; at 32 rows 1.742 with 96).
TC_MAXNREG = {8: 112, 16: 128, 32: 128}

# ---- FP8 weights (fp8.py) ----

# Tiles of the FP8 matmul for more than SKINNY_MAX_M rows (prompt chunks), by the rows they serve up to:
# (max rows, (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)). Triton's usual Hopper tiles for
# a bf16 tl.dot; the FP8 weight tile is widened in registers and takes half the shared memory of bf16's.
FP8_GEMM_TILES: tuple[tuple[float, tuple[int, ...]], ...] = (
    (64, (64, 128, 64, 8, 4, 4)),
    (float("inf"), (128, 128, 64, 8, 8, 3)),
)

# ---- Triton skinny matmul (skinny_gemm) ----

# Rows above which a matmul is no longer weight-bound: cuBLAS (F.linear) takes over.
SKINNY_MAX_M = 16
# The fastest config per (N, K, next_pow2(M)) of the Ouro-1.4B decode matmuls, each timed alone against
# F.linear (bench/gpu/gemm_bench.py prints this table). Kept where cuBLAS was a little faster alone: in the
# decode chain every kernel must be a PDL kernel for launches to overlap.
# Values: (BLOCK_N, BLOCK_K, SPLIT_K, USE_DOT, FUSED_REDUCE, num_warps, num_stages).
# fmt: off
SKINNY_CONFIGS: dict[tuple[int, int, int], tuple] = {
    (6144, 2048, 1): (16, 512, 1, False, True, 4, 3),  # qkv 9.17 us, F.linear 9.29
    (6144, 2048, 2): (64, 256, 1, True, True, 4, 4),  # qkv 9.78 us, F.linear 9.19
    (6144, 2048, 4): (64, 256, 1, True, True, 4, 4),  # qkv 9.44 us, F.linear 9.54
    (6144, 2048, 8): (64, 256, 1, True, True, 4, 4),  # qkv 9.22 us, F.linear 9.28
    (6144, 2048, 16): (64, 256, 1, True, True, 4, 4),  # qkv 8.62 us, F.linear 9.43
    (2048, 2048, 1): (64, 128, 4, True, True, 4, 4),  # o_proj 6.18 us, F.linear 6.13
    (2048, 2048, 2): (64, 128, 4, True, True, 4, 4),  # o_proj 6.25 us, F.linear 6.08
    (2048, 2048, 4): (64, 128, 4, True, True, 4, 4),  # o_proj 6.13 us, F.linear 6.19
    (2048, 2048, 8): (64, 128, 4, True, True, 4, 4),  # o_proj 5.97 us, F.linear 6.08
    (2048, 2048, 16): (64, 128, 4, True, False, 4, 4),  # o_proj 5.98 us, F.linear 6.10
    (11264, 2048, 1): (128, 128, 1, True, True, 8, 4),  # gate_up 14.68 us, F.linear 13.30
    (11264, 2048, 2): (128, 128, 1, True, True, 8, 4),  # gate_up 14.54 us, F.linear 13.37
    (11264, 2048, 4): (128, 128, 1, True, True, 8, 4),  # gate_up 14.89 us, F.linear 13.46
    (11264, 2048, 8): (128, 128, 1, True, True, 8, 4),  # gate_up 14.23 us, F.linear 13.57
    (11264, 2048, 16): (128, 128, 1, True, True, 8, 4),  # gate_up 13.69 us, F.linear 13.65
    (2048, 5632, 1): (64, 128, 4, True, True, 4, 4),  # down 9.71 us, F.linear 11.21
    (2048, 5632, 2): (64, 128, 4, True, True, 4, 4),  # down 9.53 us, F.linear 11.03
    (2048, 5632, 4): (64, 256, 4, True, True, 4, 4),  # down 9.71 us, F.linear 11.11
    (2048, 5632, 8): (64, 128, 4, True, True, 4, 4),  # down 9.44 us, F.linear 11.10
    (2048, 5632, 16): (64, 128, 4, True, True, 4, 4),  # down 9.56 us, F.linear 11.23
    # The run-ahead lanes' gated lm_head; M = 2, 4 untimed, given M = 1's.
    (49152, 2048, 1): (128, 128, 1, True, True, 8, 4),  # lm_head 50.46 us, F.linear 48.21
    (49152, 2048, 2): (128, 128, 1, True, True, 8, 4),
    (49152, 2048, 4): (128, 128, 1, True, True, 8, 4),
    (49152, 2048, 8): (128, 128, 1, True, True, 8, 4),  # lm_head 50.30 us, F.linear 49.47
    (49152, 2048, 16): (64, 128, 1, True, True, 4, 2),  # lm_head 49.33 us, F.linear 49.84
}
# fmt: on
# Other shapes: tl.dot on [BLOCK_N, BLOCK_K] weight tiles, K split until about this many programs an SM.
SKINNY_DEFAULT_BLOCK_N, SKINNY_DEFAULT_BLOCK_K = 64, 128
SKINNY_DEFAULT_PROGRAMS_PER_SM = 2
SKINNY_DEFAULT_WARPS, SKINNY_DEFAULT_STAGES = 4, 3
# The second-pass split-K sum: one program per row and BLOCK columns.
SKINNY_REDUCE_BLOCK, SKINNY_REDUCE_WARPS = 1024, 4

# ---- decode attention, one launch (decode_attention) ----

# Registers a thread at up to DECODE_ATTN_MAXNREG_ROWS rows (none over it): no spills, and loop 0.8441 /
# 0.8594 ms at 1 / 2 rows against 0.8516 / 0.8714 uncapped; at 4 / 8 rows slower (0.9207 / 0.9782 against
# 0.9106 / 0.9673).
DECODE_ATTN_MAXNREG = 128
DECODE_ATTN_MAXNREG_ROWS = 2
# Launched with the PDL attribute, loading each slice's first key/value tile before its wait, while rows x KV
# heads fit this many times the SMs: loop 0.912 / 1.070 ms at 1 / 8 rows against 0.975 / 1.134 without the
# early loads, and 1.272 against 1.306 launched plainly at 16 rows of 16 KV heads.
DECODE_ATTN_PDL_ROW_HEADS_PER_SM = 2
# An FP8 cache's tiles widen straight to fp32 up to this many rows, through fp16 over it (attention_bench,
# H100, us a layer at contexts 160 / 1,152): 8 rows 9.0 / 35.4 to fp32 against 10.8 / 40.2 through fp16;
# 32 rows 19.8 / 130.5 against 15.9 / 91.7. Row counts between were not measured.
DECODE_ATTN_FP8_TO_FP32_ROWS = 8

# ---- split-KV decode attention (split_kv_attention; its splits also shape the one-launch decode) ----

# 16-wide key tiles on two warps and 8 to 16 splits were best at 16 heads of 128, contexts 192 and 1024,
# 1 / 8 / 32 rows (5.2 us at 1 row against 12.3 for paged_attention).
SPLIT_KV_BLOCK_N = 16
SPLIT_KV_WARPS = 2
SPLIT_KV_MIN_SPLITS, SPLIT_KV_MAX_SPLITS = 8, 16
# Splits aim at about this many programs over rows x KV heads x splits.
SPLIT_KV_PROGRAMS = 1024
# Beyond SPLIT_KV_WIDE_FROM rows x KV heads (16 rows of Ouro), splits by rows x KV heads instead: (at
# most, splits), the last for any more. Within 5% of the best split count at every shape measured on an
# H100 (bench/gpu/attention_bench.py: 32 / 64 / 128 / 256 rows of 16 heads, contexts 160 and 1,152), where
# 8 splits cost 1-19% more than the best; 16-key tiles on two warps stayed best there too.
SPLIT_KV_WIDE_FROM = 256
SPLIT_KV_WIDE = ((512, 2), (1024, 1), (2048, 4), (None, 2))
# The merge kernel: one warp up to this many partial values a head (splits x head_dim), else four.
SPLIT_KV_MERGE_ONE_WARP = 2048
# Splits at most under the CPU interpreter without a config: most of 8-16 slices of a test's short context
# are empty, and 2 (the same split-and-merge code) keep the engine-level CPU tests ~2x faster.
INTERPRETER_MAX_SPLITS = 2

# ---- prefill attention (prefill_attention) ----

# Up to this many query rows a tile (tokens x heads of a group) the products run on CUDA cores, BLOCK_N
# keys a tile with query rows x head_dim x BLOCK_N about PREFILL_FMA_TILE (BLOCK_N 8 to 128).
PREFILL_FMA_MAX_M = 8
PREFILL_FMA_TILE = 4096
PREFILL_FMA_BLOCK_N = (8, 128)
# tl.dot tiles: about PREFILL_TILES_PER_ROW query tiles over the longest row, M (tokens x heads) within
# PREFILL_DOT_M; keys in blocks of 64, 32 past head_dim 128.
PREFILL_TILES_PER_ROW = 8
PREFILL_DOT_M = (16, 64)
PREFILL_BLOCK_N, PREFILL_BLOCK_N_WIDE_HEADS = 64, 32
# 4 warps: the same bits as 8 and faster (a 128-token prompt beside 1 / 8 decode rows 8.45 / 10.89 us
# against 8.82 / 11.98; 512 tokens 18.47 against 21.95); no spills at head_dim 128 (121 / 231 registers at
# BLOCK_Q 16 / 64).
PREFILL_WARPS = 4

# ---- norms (norm) ----

# One program a row, num_warps = next_pow2(H) / 128 within [4, 16]: more warps keep more of a row's loads in
# flight (loop at 1 / 8 rows: 4 warps 1.163 / 1.262 ms, 16 warps 1.128 / 1.220, 32 the same as 16).
NORM_ROW_ELEMS_PER_WARP = 128
NORM_MIN_WARPS, NORM_MAX_WARPS = 4, 16

# ---- small kernels: one program a token, row or pair ----

# RoPE + K/V write (rope_kv), SiLU-and-mul (swiglu), propagation (propagate), exit gate (exit_gate).
SMALL_KERNEL_WARPS = 4
# SiLU-and-mul: gate/up columns a program.
SILU_MUL_BLOCK = 1024
# Propagation: elements of a K/V row copied an iteration.
PROPAGATE_BLOCK = 4096
# Exit gate: hidden elements of the dot product an iteration.
EXIT_GATE_BLOCK = 2048
# Sampling: vocabulary entries a program scans an iteration (49,152 in 12); 8 warps from 2048 entries.
SAMPLE_BLOCK = 4096
SAMPLE_WIDE_BLOCK, SAMPLE_WIDE_WARPS, SAMPLE_WARPS = 2048, 8, 4

# ---- shared-prefix decode attention (cascade_attention) ----

# 64-key tiles and up to 64 rows a program as tl.dot's M, on four warps; a prefix in at most 8 slices.
CASCADE_BLOCK_N = 64
CASCADE_ROWS = 64
CASCADE_SPLITS = 8
CASCADE_WARPS = 4
