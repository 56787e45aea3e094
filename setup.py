"""Builds ouro_fast's compiled core from csrc/.

Every csrc/<name>.py (Cython pure-Python mode) and csrc/<name>.pyx becomes the
extension ouro_fast.core.<name>. The same csrc/*.py files are also installed
uncompiled as ouro_fast.core_py, the twin that tests and benchmarks compare
against. A csrc/<name>.pxd declares the C interface of ouro_fast.core.<name>
(augmenting <name>.py, or shared by <name>.pyx) and is what other modules
cimport. A missing C compiler is a build error, never a silent fallback.
"""

import os
import shutil
import sysconfig
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
CSRC = HERE / "csrc"
# Where Cython finds csrc/*.pxd under the modules' qualified names (ouro_fast/core/<name>.pxd).
PXD_ROOT = HERE / "build" / "pxd"


class BuildCore(build_ext):
    def run(self):
        cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
        if shutil.which(cc) is None and shutil.which("cc") is None:
            raise SystemExit(
                f"ouro_fast needs a C compiler to build its compiled core (tried {cc!r} and 'cc'); "
                "install one (e.g. apt-get install build-essential) and run pip install again."
            )
        super().run()


def core_sources():
    """One source per module: <name>.pyx where it exists (its <name>.py is then the twin), else <name>.py."""
    pyx = {p.stem for p in CSRC.glob("*.pyx")}
    py = [p for p in CSRC.glob("*.py") if p.stem != "__init__" and p.stem not in pyx]
    sources = sorted([*CSRC.glob("*.pyx"), *py])
    # Developer switch: rebuild only some modules in place (comma-separated names).
    only = os.environ.get("OURO_FAST_BUILD_ONLY")
    if only:
        sources = [p for p in sources if p.stem in only.split(",")]
    return sources


def pxd_include_path() -> Path:
    """A directory in which ouro_fast/core is csrc/, for Cython's include path.

    Cython looks a module's .pxd up by the module's qualified name, both the augmenting
    .pxd of the module being compiled and every cimport; sources in csrc/ are compiled as
    ouro_fast.core.<name>, so csrc/<name>.pxd is found only through this link.
    """
    link = PXD_ROOT / "ouro_fast" / "core"
    target = os.path.relpath(CSRC, link.parent)
    if not (link.is_symlink() and os.readlink(link) == target):
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)
        link.symlink_to(target, target_is_directory=True)
    return PXD_ROOT


def core_extensions():
    sources = core_sources()
    return [
        Extension(
            f"ouro_fast.core.{src.stem}",
            [str(src.relative_to(HERE))],
            include_dirs=[str(CSRC.relative_to(HERE))],
            extra_compile_args=["-O3", "-std=c11"],
        )
        for src in sources
    ]


setup(
    packages=[*find_packages(include=["ouro_fast", "ouro_fast.*"]), "ouro_fast.core_py"],
    package_dir={"ouro_fast.core_py": "csrc"},
    ext_modules=cythonize(
        core_extensions(),
        language_level=3,
        include_path=[str(pxd_include_path())],
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
    cmdclass={"build_ext": BuildCore},
)
