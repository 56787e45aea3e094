"""bench/gpu/attn_resources.py compiles the fused decode attention for sm_90 offline (no GPU needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before triton is imported, as the kernel tests set it: a module collected before theirs that imported
    # the kernels uninterpreted would leave them compiled-only for every later test on a CPU machine.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")
TOOL = Path(__file__).parent.parent / "bench" / "gpu" / "attn_resources.py"
sys.path.insert(0, str(TOOL.parent))

import attn_resources  # noqa: E402


def test_signature_names_every_runtime_argument_of_the_kernel():
    # A kernel argument added or renamed without the tool would compile the wrong kernel (or none).
    params = attn_resources.fused_decode._fused_decode_kernel.arg_names
    runtime = [p for p in params if not p.isupper()]
    assert list(attn_resources.signature()) == runtime


def test_constants_name_the_kernels_compile_time_parameters_in_order():
    # They are passed by position: a gap would set the next one's value on the wrong parameter.
    params = [p for p in attn_resources.fused_decode._fused_decode_kernel.arg_names if p.isupper()]
    got = list(attn_resources.constants(16, 1, 8))
    assert got == params[: len(got)]
    assert "STAMP" in got


def test_reports_registers_and_shared_memory_of_each_setting():
    # Its own process: other test modules run triton's interpreter, which compiles nothing.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(TOOL), "--settings", "16:2:1", "8:2:0", "--maxnreg", "128"]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["block_n"], r["early_kv"]) for r in rows] == [(16, 1), (8, 0)]
    for r in rows:
        assert 0 < r["registers"] <= 128
        assert r["registers_per_cta"] == r["registers"] * 64
        assert r["shared_bytes"] > 0 and r["stack_bytes"] >= 0


def test_refuses_to_run_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        attn_resources.resources(block_n=16, warps=2, early=1)
