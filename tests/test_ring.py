"""RequestRing: the compiled ring (C11 atomics) and its uncompiled twin, checked against a deque."""

import os
import shutil
import subprocess
import sysconfig
import threading
import time
from collections import deque
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ouro_fast.core_py.ring as ring_py
from ouro_fast.core import ring as ring_c

CSRC = Path(__file__).resolve().parent.parent / "csrc"
IMPLS = pytest.mark.parametrize("impl", [ring_c, ring_py], ids=["compiled", "twin"])


@IMPLS
def test_fifo_order(impl):
    ring = impl.RequestRing(8)
    assert ring.pop() is None and len(ring) == 0
    for i in range(5):
        assert ring.push(i % 3, 1000 + i)
    assert len(ring) == 5
    assert ring.pop() == (0, 1000)
    assert ring.pop_many(3) == [(1, 1001), (2, 1002), (0, 1003)]
    assert ring.pop() == (1, 1004)
    assert ring.pop() is None and ring.pop_many(4) == []


@IMPLS
def test_full_ring_refuses_without_losing_records(impl):
    ring = impl.RequestRing(4)
    assert all(ring.push(1, k) for k in range(4))
    assert ring.push(1, 99) is False
    assert len(ring) == 4
    assert ring.pop() == (1, 0)
    assert ring.push(2, 4) is True and ring.push(2, 5) is False
    assert ring.pop_many(10) == [(1, 1), (1, 2), (1, 3), (2, 4)]


@IMPLS
def test_wraparound_many_times(impl):
    ring = impl.RequestRing(4)
    pushed = popped = 0
    for round_ in range(1000):
        for _ in range(round_ % 4 + 1):
            assert ring.push(pushed % 5, pushed)
            pushed += 1
        got = ring.pop_many(2) if round_ % 2 else [ring.pop()]
        got += ring.pop_many(4)
        assert got == [(k % 5, k) for k in range(popped, popped + len(got))]
        popped += len(got)
        assert len(ring) == 0
    assert pushed == popped > 4 * 500


@IMPLS
@pytest.mark.parametrize(("asked", "held"), [(1, 1), (2, 2), (3, 4), (5, 8), (64, 64), (1000, 1024)])
def test_capacity_rounds_up_to_power_of_two(impl, asked, held):
    ring = impl.RequestRing(asked)
    assert ring.capacity == held
    assert sum(ring.push(0, k) for k in range(held + 3)) == held


@IMPLS
def test_bad_arguments(impl):
    for bad in (0, -3, impl.MAX_CAPACITY + 1):
        with pytest.raises(ValueError):
            impl.RequestRing(bad)
    with pytest.raises(TypeError):
        impl.RequestRing(2.5)
    ring = impl.RequestRing(2)
    with pytest.raises(OverflowError):
        ring.push(1 << 31, 0)
    with pytest.raises(OverflowError):
        ring.push(0, 1 << 63)
    with pytest.raises(TypeError):
        ring.push(1.0, 0)
    assert ring.push(-(1 << 31), -(1 << 63)) and ring.pop() == (-(1 << 31), -(1 << 63))
    assert len(ring) == 0


@IMPLS
@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.one_of(st.integers(0, 3), st.tuples(st.just("many"), st.integers(-1, 6))), max_size=80)
)
def test_matches_bounded_deque(impl, ops):
    ring, ref, key = impl.RequestRing(4), deque(), 0
    for op in ops:
        if isinstance(op, int) and op < 3:
            ok = ring.push(op, key)
            assert ok == (len(ref) < 4)
            if ok:
                ref.append((op, key))
            key += 1
        elif isinstance(op, int):
            assert ring.pop() == (ref.popleft() if ref else None)
        else:
            n = max(0, min(op[1], len(ref)))
            assert ring.pop_many(op[1]) == [ref.popleft() for _ in range(n)]
        assert len(ring) == len(ref)


@IMPLS
def test_two_thread_stress_keeps_order_and_loses_nothing(impl):
    total, ring = 200_000, impl.RequestRing(64)
    deadline = time.monotonic() + 60
    errors: list[str] = []

    def produce():
        for k in range(total):
            while not ring.push(k & 7, k):
                if time.monotonic() > deadline:
                    errors.append(f"producer stuck at {k}")
                    return
                time.sleep(0)  # full: let the consumer run

    def consume():
        expect = 0
        while expect < total:
            got = ring.pop_many(32) if expect & 1 else ([r] if (r := ring.pop()) else [])
            if not got:
                if time.monotonic() > deadline:
                    errors.append(f"consumer stuck at {expect}")
                    return
                time.sleep(0)  # empty: let the producer run
            for op, k in got:
                if (op, k) != (expect & 7, expect):
                    errors.append(f"got {(op, k)} expecting {(expect & 7, expect)}")
                    return
                expect += 1

    threads = [threading.Thread(target=f, daemon=True) for f in (consume, produce)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=70)
    assert not any(t.is_alive() for t in threads), "stress test did not finish"
    assert errors == []
    assert len(ring) == 0 and ring.pop() is None


STRESS_C = r"""
#include <pthread.h>
#include <stdio.h>
#include "ring.h"
#define N 200000
static ouro_ring *ring;
static void *producer(void *arg) {
    (void)arg;
    for (int64_t i = 0; i < N; i++)
        while (!ouro_ring_push(ring, (int32_t)(i & 7), i)) { }
    return NULL;
}
int main(void) {
    ring = ouro_ring_create(64);
    pthread_t t;
    pthread_create(&t, NULL, producer, NULL);
    int64_t expect = 0;
    while (expect < N) {
        size_t n = ouro_ring_readable(ring, 16);
        if (n > 16) n = 16;
        for (size_t i = 0; i < n; i++, expect++) {
            ouro_ring_record rec = ouro_ring_peek(ring, i);
            if (rec.key != expect || rec.op != (int32_t)(expect & 7)) return 3;
        }
        ouro_ring_consume(ring, n);
    }
    pthread_join(t, NULL);
    if (ouro_ring_size(ring) != 0) return 4;
    ouro_ring_destroy(ring);
    puts("ok");
    return 0;
}
"""


def _compiler() -> str:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    found = shutil.which(cc) or shutil.which("cc")
    assert found, "a C compiler is required to build the core, and so to test ring.h"
    return found


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "tsan"])
def test_ring_h_without_the_gil(tmp_path, sanitize):
    """Two pthreads on ring.h alone: order and no loss; under ThreadSanitizer, no data race either."""
    src = tmp_path / "stress.c"
    src.write_text(STRESS_C)
    exe = tmp_path / "stress"
    flags = ["-O2", "-std=c11", "-Wall", "-Werror", "-pthread", f"-I{CSRC}"]
    if sanitize:
        flags.append("-fsanitize=thread")
    built = subprocess.run([_compiler(), *flags, str(src), "-o", str(exe)], capture_output=True, text=True)
    if sanitize and built.returncode != 0:
        pytest.skip(f"this compiler cannot build with ThreadSanitizer: {built.stderr[-200:]}")
    assert built.returncode == 0, built.stderr
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"}
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stderr[-2000:]
