"""The padded shapes GPU steps run at, so that a few CUDA graphs cover every step.

A step runs padded to (rows, tokens, max_q_len), padding rows and tokens doing
nothing: decode steps by row count (powers of two); steps that carry a prompt
chunk by token count alone (at least PREFILL_MIN_ROWS rows, longest row = the
token bucket; token buckets are powers of two and, above 64, 9/16, 5/8 and 3/4
of each). Every shape is captured at start-up (up to MAX_GRAPHS), so no request
waits for a capture; a shape beyond runs eagerly at the same padding.
"""

from __future__ import annotations

MAX_GRAPHS = 48  # captured (rows, tokens, max_q_len) shapes; steps beyond run eagerly at the same padding
# Rows of a step that carries a prompt chunk: padding rows cost an empty attention program and a
# gate row each, and one row bucket keeps the prefill graphs to one per token bucket.
PREFILL_MIN_ROWS = 64
# Token buckets above 64 tokens, in sixteenths of the next power of two (the last is the power itself):
# padding adds at most a third, and a 128-token prompt beside 8 decode lanes runs at 144 tokens.
BUCKET_SIXTEENTHS = (9, 10, 12, 16)


def step_shape(rows: int, tokens: int, max_len: int, max_rows: int, max_tokens: int) -> tuple[int, int, int]:
    """The padded (rows, tokens, max_q_len) a step runs at: powers of two (capped by the buffers).
    Decode steps (max_len 1) keep their row bucket; steps with a prompt chunk are padded to at
    least PREFILL_MIN_ROWS rows and to a longest row of the whole token bucket."""
    if max_len <= 1:
        r_b = min(pow2(rows), max_rows)
        return r_b, min(max(pow2(tokens), r_b), max_tokens), 1
    r_b = min(max(pow2(rows), PREFILL_MIN_ROWS), max_rows, max_tokens)
    n_b = min(max(_token_bucket(tokens), r_b), max_tokens)
    return r_b, n_b, n_b


def _token_bucket(n: int) -> int:
    """Tokens a step with a prompt chunk is padded to: powers of two up to 64, then the smallest of
    9/16, 5/8, 3/4 and 1 times the next power of two that holds n, so padding adds at most a third.
    A 128-token prompt with eight decode lanes (concurrency 8) runs at 144 tokens, not 192 or 256: a
    rider loop takes 1.73 ms there against 1.82 at 192 on the H200."""
    p = pow2(n)
    if p <= 64:
        return p
    return next(p * f // 16 for f in BUCKET_SIXTEENTHS if n <= p * f // 16)


def _token_buckets(max_tokens: int) -> set[int]:
    """Every value _token_bucket takes up to max_tokens, and max_tokens itself."""
    pows = [1 << i for i in range(max_tokens.bit_length() + 1)]
    subs = {p * f // 16 for p in pows if p > 64 for f in BUCKET_SIXTEENTHS}
    return {b for b in set(pows) | subs if b < max_tokens} | {max_tokens}


def decode_shapes(max_rows: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """Every shape step_shape gives a decode step (one token a row), fewest rows first."""
    rows = _buckets(min(max_rows, max_tokens))
    return sorted({step_shape(r, r, 1, max_rows, max_tokens) for r in rows})


def prefill_shapes(max_rows: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """Every shape step_shape gives a step with a prompt chunk, fewest tokens first."""
    rows = _buckets(max_rows)
    toks = {t for t in _token_buckets(max_tokens) if t > 1}
    shapes = {step_shape(r, t, 2, max_rows, max_tokens) for r in rows for t in toks if r <= t}
    return sorted(shapes, key=lambda s: (s[1], s[0]))


def _buckets(cap: int) -> set[int]:
    # A representative of every bucket up to cap: the powers of two below it, and cap itself.
    return {1 << i for i in range(cap.bit_length()) if 1 << i < cap} | {cap}


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
