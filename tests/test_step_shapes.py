"""The padded step shapes of the GPU runner: every step fits one, and few cover all (no GPU needed)."""

import pytest

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.engine.gpu.shapes import (  # noqa: E402
    MAX_GRAPHS,
    PREFILL_MIN_ROWS,
    decode_shapes,
    prefill_shapes,
    step_shape,
)


@pytest.mark.parametrize("max_rows,max_tokens", [(64, 512), (64, 16), (8, 40), (48, 500), (256, 2048)])
def test_every_prefill_step_fits_a_start_up_shape(max_rows, max_tokens):
    shapes = set(prefill_shapes(max_rows, max_tokens))
    for rows in range(1, min(max_rows, max_tokens) + 1):
        for tokens in range(rows + 1, max_tokens + 1, 1 if max_tokens <= 64 else 7):
            for max_len in {2, tokens - rows + 1}:
                r, n, q = step_shape(rows, tokens, max_len, max_rows, max_tokens)
                assert (r, n, q) in shapes, (rows, tokens, max_len)
                assert rows <= r <= max_rows and tokens <= n <= max_tokens and max_len <= q <= n


def test_prefill_shapes_are_one_per_token_bucket_by_default():
    # 64 rows and 512 tokens: a prefill graph per power of two and, above 64, per
    # 9/16, 5/8 and 3/4 of one.
    assert [n for _, n, _ in prefill_shapes(64, 512)] == [
        64, 72, 80, 96, 128, 144, 160, 192, 256, 288, 320, 384, 512
    ]  # fmt: skip
    assert all(r == PREFILL_MIN_ROWS and q == n for r, n, q in prefill_shapes(64, 512))
    assert step_shape(1, 128, 128, 64, 512) == (PREFILL_MIN_ROWS, 128, 128)
    # 64, 128, 256 rows by 64 (128, 256) .. 8192 tokens, and three fractions of 128 .. 8192 each.
    assert len(prefill_shapes(256, 8192)) == (8 + 7 + 6) + 3 * (7 + 6 + 5)
    assert len(decode_shapes(64, 512) + prefill_shapes(64, 512)) <= MAX_GRAPHS


def test_a_step_with_a_prompt_pads_by_at_most_a_third():
    # A 128-token prompt beside eight decode lanes (concurrency 8) runs at 144 tokens, not 192 or 256.
    assert step_shape(9, 136, 128, 64, 512) == (64, 144, 144)
    assert step_shape(8, 135, 128, 64, 512) == (64, 144, 144)
    assert step_shape(3, 150, 128, 64, 512) == (64, 160, 160)
    for tokens in range(65, 513):
        _, n, _ = step_shape(2, tokens, 2, 64, 512)
        assert tokens <= n and 3 * n <= 4 * tokens, tokens
    # The smallest bucket that holds the step: one bucket down would not.
    buckets = sorted({n for _, n, _ in prefill_shapes(64, 512)})
    for tokens in range(65, 513):
        n = step_shape(2, tokens, 2, 64, 512)[1]
        assert all(b < tokens for b in buckets if b < n), tokens


@pytest.mark.parametrize("max_rows,max_tokens", [(64, 512), (48, 500), (64, 16), (5, 40)])
def test_every_decode_step_fits_a_start_up_shape(max_rows, max_tokens):
    shapes = set(decode_shapes(max_rows, max_tokens))
    for rows in range(1, min(max_rows, max_tokens) + 1):
        r, n, q = step_shape(rows, rows, 1, max_rows, max_tokens)
        assert (r, n, q) in shapes and rows <= r <= max_rows and rows <= n <= max_tokens and q == 1
    assert decode_shapes(64, 512) == [(b, b, 1) for b in (1, 2, 4, 8, 16, 32, 64)]


def test_decode_steps_keep_their_row_bucket():
    assert step_shape(3, 3, 1, 64, 512) == (4, 4, 1)
    assert step_shape(1, 1, 1, 64, 512) == (1, 1, 1)
    assert step_shape(64, 64, 1, 64, 512) == (64, 64, 1)
    assert step_shape(5, 5, 1, 6, 512) == (6, 8, 1)
