"""ouro_fast: a serving engine for the looped language model Ouro.

from ouro_fast import LLM, SamplingParams
LLM().generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig"]


def __getattr__(name):
    # Lazy, so that `import ouro_fast.server` in Sanic's main process stays light.
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sampling import SamplingParams

        return SamplingParams
    if name in ("Engine", "EngineConfig"):
        from .engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
