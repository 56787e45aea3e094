"""The build: no C compiler means a clear error, never a silent fallback to the uncompiled twin."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ouro_fast.core.loop_scheduler as compiled

ROOT = Path(__file__).resolve().parents[1]


def test_installed_core_is_compiled():
    assert Path(compiled.__file__).suffix in (".so", ".pyd")


def test_missing_compiler_is_a_clear_build_error(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), "CC": "no-such-cc", "OURO_FAST_BUILD_ONLY": "ring"}
    cmd = [
        sys.executable,
        "setup.py",
        "-q",
        "build_ext",
        "--build-lib",
        str(tmp_path),
        "--build-temp",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if "No module named 'Cython'" in proc.stderr:
        pytest.fail("Cython must be importable to run setup.py")
    assert proc.returncode != 0
    assert "needs a C compiler" in proc.stderr + proc.stdout
    assert not list(tmp_path.rglob("*.so"))
