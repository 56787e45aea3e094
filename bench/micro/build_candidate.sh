#!/usr/bin/env bash
# Build a patched LoopScheduler beside the tree, for `python -m bench.micro.scheduler --candidate MODULE`:
# copies csrc/loop_scheduler.py, applies a diff made against it (default: the proposed fast path),
# compiles it with the project's Cython directives as the module `loop_scheduler_candidate`, and
# prints the folder to put on PYTHONPATH. The project's own build is not touched.
#   dir=$(bash bench/micro/build_candidate.sh) && PYTHONPATH=$dir python -m bench.micro.scheduler --candidate loop_scheduler_candidate
set -euo pipefail
cd "$(dirname "$0")/../.."
DIFF=${1:-bench/proposals/loop_scheduler-fast-path.diff}
PY=${PYTHON:-python3}
DEST=${CANDIDATE_DIR:-/tmp/ouro_fast-sched-candidate}
mkdir -p "$DEST/csrc"
cp csrc/loop_scheduler.py "$DEST/csrc/loop_scheduler.py"
(cd "$DEST" && patch -s --fuzz=0 -p1 < "$OLDPWD/$DIFF")  # no fuzz: a stale diff fails here
cp "$DEST/csrc/loop_scheduler.py" "$DEST/loop_scheduler_candidate.py"
(cd "$DEST" && "$PY" - >&2 <<'PY'
from Cython.Build import cythonize
from setuptools import Extension, setup

ext = Extension("loop_scheduler_candidate", ["loop_scheduler_candidate.py"], extra_compile_args=["-O3", "-std=c11"])
directives = {"boundscheck": False, "wraparound": False, "cdivision": True}
setup(
    script_args=["build_ext", "--inplace", "-q"],
    ext_modules=cythonize([ext], language_level=3, compiler_directives=directives, quiet=True),
)
PY
)
echo "$DEST"
