"""The OpenAI-compatible HTTP server: `sanic ouro_fast.server:app` or `ouro-fast serve`."""

from .app import app

__all__ = ["app"]
