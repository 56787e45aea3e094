"""The OpenAI-compatible HTTP server: `sanic ouro_fast.server:app` or `ouro-fast serve`."""

__all__ = ["app"]


def __getattr__(name):
    # Lazy: `ouro-fast make-checkpoint` builds the CLI from server.launch without importing Sanic's app.
    if name == "app":
        from .app import app

        globals()["app"] = app  # the Sanic app, not its module of the same name
        return app
    raise AttributeError(name)
