"""Benchmarks of ouro_fast: micro-benchmarks of the compiled core, the engine, and the clients."""
