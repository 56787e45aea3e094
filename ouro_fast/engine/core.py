"""The compiled core's classes, imported from the extension modules built by pip install .

There is no silent fallback: without the compiled modules this import fails
and says how to build them. Tests and benchmarks reach the uncompiled twin
explicitly through ouro_fast.core_py.
"""

try:
    from ..core.block_table import BlockTable
    from ..core.loop_scheduler import LoopScheduler
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        f"ouro_fast's compiled core is missing ({e}). Build it with `pip install .` "
        "(or `python setup.py build_ext --inplace` in a source checkout); a C compiler is required."
    ) from e

__all__ = ["BlockTable", "LoopScheduler"]
