"""Compile the Triton variants a start-up launches side by side, before it runs any of them.

Triton compiles a kernel variant at its first launch, and builds its launcher (a C extension, with gcc),
one after another: on a fresh H200 machine the server's start-up compiled 40 variants, ~18 s of its ~32 s.
`precompile(walk)` calls `walk` with every launch turned into
a compile submitted to a thread pool (triton's AsyncCompileMode, with the launch's `warmup` flag: compile,
do not run), which also builds the launcher and loads the binary; the compiler's passes, ptxas and gcc
release the GIL, so the variants get ready in parallel, and the warm-ups and captures after the walk find
them in the kernel cache. The walk's torch ops still run, on outputs the skipped kernels never wrote: call
it only where a warm-up would run anyway (start-up, over scratch state), never while steps are in flight.
The pool's size is the engine's compile_threads (default: the CPUs, at most 16; 1 turns the walk off).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .launch import interpreting

logger = logging.getLogger("ouro_fast")
_WALKING = threading.Lock()  # the patch below is process-wide: one walk at a time


class _Pool(ThreadPoolExecutor):
    """The compile threads: each compile also readies its kernel to launch (see _compile_and_load); counts
    what it was given (AsyncCompileMode submits one compile per new variant)."""

    submitted = 0

    def __init__(self, threads: int, load: bool):
        from triton.runtime import driver  # noqa: PLC0415

        device = driver.active.get_current_device()
        set_device = getattr(driver.active, "set_current_device", None)  # a kernel loads on the current one
        super().__init__(
            threads, thread_name_prefix="triton-compile", initializer=set_device, initargs=(device,)
        )
        self.load = load

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        return super().submit(_compile_and_load, fn, self.load, *args, **kwargs)


def _compile_and_load(compile_fn, load: bool, *args, **kwargs):
    kernel = compile_fn(*args, **kwargs)
    # A kernel's first launch also builds its launcher (a C extension, with gcc, ~0.2-0.5 s on a cold cache)
    # and loads its binary: do both here too, in parallel, rather than one by one in the capture.
    init = getattr(kernel, "_init_handles", None)
    if load and init is not None:
        init()
    return kernel


def default_compile_threads() -> int:
    """The compile pool's default size: the CPUs, at most 16."""
    return min(os.cpu_count() or 1, 16)


def precompile(walk: Callable[[], None], threads: int | None = None) -> int:
    """Run `walk` with its Triton launches compiled in parallel instead of run; return how many variants it
    compiled (0, and `walk` not called, where that cannot help: the interpreter, one thread, an old triton).
    A compile error is raised here, after the walk, as the launch would have raised it."""
    threads = default_compile_threads() if threads is None else threads
    if interpreting() or threads < 2:
        return 0
    import triton  # noqa: PLC0415 (only where kernels compile)
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    if not hasattr(triton, "AsyncCompileMode"):  # triton < 3.5
        return 0
    from triton.runtime import driver  # noqa: PLC0415

    load = hasattr(driver.active, "launcher_cls")  # a GPU driver (a mock one only compiles)
    t0 = time.perf_counter()
    with _WALKING, _Pool(threads, load) as pool:
        run = JITFunction.run

        def compile_run(self, *args, grid, warmup, **kwargs):
            return run(self, *args, grid=grid, warmup=True, **kwargs)

        JITFunction.run = compile_run
        try:
            # On exit it waits for every compile, files each in its kernel's cache and raises any error.
            with triton.AsyncCompileMode(pool):
                walk()
        finally:
            JITFunction.run = run
    logger.info("compiled %d kernel variants on %d threads in %.1f s", pool.submitted, threads,
                time.perf_counter() - t0)  # fmt: skip
    return pool.submitted
