"""Micro-benchmarks of the compiled core vs its uncompiled twin (one module per component)."""
