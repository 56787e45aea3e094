"""The compiled core (built from csrc/ by pip install .).

Importing a submodule that was not compiled fails with a clear message: there
is no silent fallback to the uncompiled twin (ouro_fast.core_py).
"""
