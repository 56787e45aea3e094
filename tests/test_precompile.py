"""kernels/precompile.py: inside the walk a launch compiles (in a thread pool) and does not run; afterwards
every variant is in its kernel's cache; a compile error surfaces; off under the interpreter.

The compiles run in subprocesses with the mock driver of tests/offline_compile.py (sm_90, no GPU)."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, as every kernel test file does
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.kernels.precompile import default_compile_threads, precompile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SNIPPET = """
import json, sys
sys.path[:0] = [ROOT, ROOT + "/tests"]
import torch, triton, triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction
import offline_compile as oc
from ouro_fast.kernels.precompile import precompile

@triton.jit
def double(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

@triton.jit
def broken(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.load(x_ptr) + tl.no_such_op(1))

oc.install()
run = JITFunction.run
x = torch.ones(1024)
misses = []  # the kernel-cache misses: called before every compile
knobs.runtime.jit_cache_hook = lambda **kw: misses.append(kw["repr"].split("[")[0]) and None

def walk():
    for block in (64, 128, 256, 64):  # three variants, one launched twice
        double[(1024 // block,)](x, 1024, BLOCK=block)

n = precompile(walk, threads=4)
out = {"compiled": n, "misses_walk": len(misses), "untouched": bool((x == 1).all()),
       "restored": JITFunction.run is run}
misses.clear()
for block in (64, 128, 256):
    double.warmup(x, 1024, BLOCK=block, grid=(1,))
out["misses_after"] = len(misses)
try:
    precompile(lambda: broken[(1,)](x, BLOCK=16), threads=2)
    out["error"] = None
except Exception as e:
    out["error"] = type(e).__name__
out["restored_after_error"] = JITFunction.run is run
print(json.dumps(out))
"""


def test_walk_compiles_in_parallel_without_running(tmp_path):
    script = tmp_path / "walk.py"  # triton reads a kernel's source from its file
    script.write_text(f"ROOT = {str(ROOT)!r}\n" + SNIPPET)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # cold: every variant compiles here
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["compiled"] == 3  # the repeated launch shares its variant's compile
    assert got["misses_walk"] >= 3  # each variant missed the cache during the walk
    assert got["untouched"]  # nothing ran: the tensor is as it was
    assert got["restored"] and got["restored_after_error"]
    assert got["misses_after"] == 0  # every variant is in the kernel's cache now
    assert got["error"] is not None  # the broken kernel's compile error surfaced


def test_off_under_the_interpreter_and_with_one_thread(monkeypatch):
    called = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert precompile(lambda: called.append(1), threads=8) == 0
    monkeypatch.delenv("TRITON_INTERPRET")
    assert precompile(lambda: called.append(1), threads=1) == 0
    assert called == []  # the walk is skipped: the launches after it compile as before


def test_default_compile_threads_are_the_cpus_up_to_16():
    assert default_compile_threads() == min(os.cpu_count() or 1, 16)


def _generate(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.request.output_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the start-up capture runs on a GPU only")
def test_start_up_walk_compiles_everything_the_capture_launches(model_dir, monkeypatch):
    from triton import knobs
    from triton.runtime.jit import JITFunction

    from ouro_fast.engine.engine import Engine, EngineConfig
    from ouro_fast.engine.sampling import SamplingParams

    original, misses = JITFunction.run, {"before": 0, "walk": 0, "after": 0}

    def count(**_):  # called before every compile (a kernel-cache miss): before, in or after the walk
        if JITFunction.run is not original:
            misses["walk"] += 1
        else:
            misses["after" if misses["walk"] else "before"] += 1

    for obj in gc.get_objects():  # forget what this process compiled: every variant misses once again
        if isinstance(obj, JITFunction):
            obj.device_caches.clear()
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", count)
    opts = dict(model=model_dir, dtype="bfloat16", runner="triton", max_num_batched_tokens=16)
    engine = Engine(EngineConfig(**opts))
    walked, after = misses["walk"], misses["after"]
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    assert walked > 0 and after == 0, misses  # the walk compiled every variant; the capture needed no more
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 30))]
    got = _generate(engine, prompts, params)
    del engine
    serial = EngineConfig(**opts, compile_threads=1)  # no walk: each variant compiles at its first launch
    assert _generate(Engine(serial), prompts, params) == got
