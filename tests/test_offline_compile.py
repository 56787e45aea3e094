"""bench/gpu/offline_compile.py: with its mock driver, triton compiles a kernel for sm_90 (ptxas included)
on a machine without a GPU, and ptxas's register count is read back."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before triton is imported, as the kernel tests set it: collected first, this module would otherwise
    # leave the kernels compiled-only for every later test on a CPU machine. Its compiles run in subprocesses.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

ROOT = Path(__file__).resolve().parents[1]
SNIPPET = """
import json, triton, triton.language as tl
sys_path = __import__("sys").path
sys_path.insert(0, ROOT + "/bench/gpu")
import offline_compile as oc

@triton.jit
def axpy(x_ptr, y_ptr, a, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, a * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

oc.install()
import torch
x = torch.empty(1024)
k = axpy.warmup(x, x, 2.0, 1024, BLOCK=256, grid=(4,))
print(json.dumps({"target": str(k.metadata.target), **oc.ptxas_usage(k.asm["ptx"])}))
"""


def test_compiles_for_sm90_without_a_gpu(tmp_path):
    script = tmp_path / "axpy.py"  # triton reads a kernel's source from its file
    script.write_text(f"ROOT = {str(ROOT)!r}\n" + SNIPPET)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "90" in got["target"] and got["registers"] > 0 and got["spill_bytes"] == 0


def test_compiles_the_prompt_attention_at_given_tiles():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    args = [sys.executable, "bench/gpu/offline_compile.py", "--paged", "16:64:4", "16:64:8"]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [ast.literal_eval(line) for line in done.stdout.strip().splitlines()]  # the tool prints dict reprs
    assert [(r["block_q"], r["warps"]) for r in rows] == [(16, 4), (16, 8)]
    assert all(r["registers"] > 0 and r["smem"] > 0 for r in rows)
