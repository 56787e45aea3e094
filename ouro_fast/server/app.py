"""The Sanic application: routes, listeners, the API-key check and the one error handler.

Importing this module is cheap (no torch, no model): Sanic imports it in its
main process too. The engine is built by the owner thread, started in the
worker's before_server_start listener, and shut down in before_server_stop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import sys
import time

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sanic import Request, Sanic
from sanic.exceptions import SanicException
from sanic.response import HTTPResponse

from . import generate, protocol
from .config import ServerConfig
from .engine_client import EngineClient
from .protocol import ApiError

logger = logging.getLogger("ouro_fast.server")

_LAUNCH_ENV = "_OURO_FAST_LAUNCH_EPOCH"
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def _process_start_epoch() -> float:
    """When this process started (Linux /proc), else now."""
    try:
        with open("/proc/self/stat", "rb") as f:
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


# Sanic's main process imports this module before it spawns the worker, which inherits the
# variable: "process start" then means the launch of the command, in either mode.
os.environ.setdefault(_LAUNCH_ENV, repr(_process_start_epoch()))

app = Sanic("ouro_fast")
app.config.ACCESS_LOG = False
app.config.FALLBACK_ERROR_FORMAT = "json"


_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_INVALID_STATUSES = (400, 413, 422)


def _client(request: Request) -> EngineClient:
    return request.app.ctx.client


def _setup_logging(level: str) -> None:
    root = logging.getLogger("ouro_fast")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(level.upper())


def apply_gil_switch(config: ServerConfig) -> None:
    # The engine-owner thread shares the GIL with the event loop: a shorter interval gets it back sooner.
    if config.gil_switch_ms is not None:
        sys.setswitchinterval(config.gil_switch_ms / 1000)


@app.before_server_start
async def start_engine(app: Sanic) -> None:
    config = ServerConfig.from_env()
    _setup_logging(config.log_level)
    if app.state.workers > 1:
        raise RuntimeError("ouro_fast serves from one Sanic worker (one engine per process): drop --workers")
    apply_gil_switch(config)
    app.config.REQUEST_MAX_SIZE = config.max_body_bytes
    app.config.RESPONSE_TIMEOUT = config.response_timeout
    if config.test_faults:
        logger.warning("TEST-ONLY fault injection is on (OURO_FAST_TEST_FAULTS=%s)", config.test_faults)
    app.ctx.config = config
    app.ctx.client = EngineClient(config, asyncio.get_running_loop(), on_failure=lambda: app.stop())
    app.ctx.client.start(float(os.environ.get(_LAUNCH_ENV) or time.time()))


@app.before_server_stop
async def stop_engine(app: Sanic) -> None:
    client = getattr(app.ctx, "client", None)
    if client is not None:
        await client.drain(app.ctx.config.drain_delay)
        await client.shutdown(app.ctx.config.shutdown_grace)


@app.on_request
async def check_api_key(request: Request) -> None:
    key = request.app.ctx.config.api_key
    if not key or not request.path.startswith(_PROTECTED_PREFIXES):
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise ApiError(
            401, "a valid API key is required (Authorization: Bearer <key>)", code="invalid_api_key"
        )


@app.exception(Exception)
async def on_error(request: Request, exc: Exception) -> HTTPResponse:
    if isinstance(exc, ApiError):
        err = exc
    elif isinstance(exc, SanicException):
        status = exc.status_code
        err = ApiError(status, str(exc) or "request failed", retry_after=1 if status == 503 else None)
    else:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        err = ApiError(500, f"internal server error: {type(exc).__name__}")
    submitted = getattr(request.ctx, "submitted", False)
    if err.status in _INVALID_STATUSES and request.path in _GENERATION_PATHS and not submitted:
        # Refused while parsing, before the engine saw it (the engine's refusals are counted by the client).
        _client(request).metrics.rejected("invalid")
    return generate.json_response(err.body(), err.status, err.headers())


@app.post("/v1/completions")
async def completions(request: Request):
    client = _client(request)
    req = protocol.parse_completion(protocol.parse_json(request.body), client.require_ready())
    return await generate.serve(request, client, req)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request):
    client = _client(request)
    info = client.require_ready()
    req = protocol.parse_chat(protocol.parse_json(request.body), info, client.tokenizer.apply_chat_template)
    return await generate.serve(request, client, req)


@app.get("/v1/models")
async def models(request: Request) -> HTTPResponse:
    return generate.json_response(protocol.models_response(_client(request).require_ready()))


@app.post("/tokenize")
async def tokenize(request: Request) -> HTTPResponse:
    client = _client(request)
    info = client.require_ready()
    text = protocol.parse_tokenize(
        protocol.parse_json(request.body), info, client.tokenizer.apply_chat_template
    )
    ids = await client.encode(text)
    return generate.json_response({"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids})


@app.post("/detokenize")
async def detokenize(request: Request) -> HTTPResponse:
    client = _client(request)
    ids = protocol.parse_detokenize(protocol.parse_json(request.body), client.require_ready())
    return generate.json_response({"prompt": client.tokenizer.decode(ids, skip_special_tokens=False)})


@app.get("/version")
async def version(request: Request) -> HTTPResponse:
    from .. import __version__

    return generate.json_response({"version": __version__})


@app.get("/health")
async def health(request: Request) -> HTTPResponse:
    client = _client(request)
    if client.healthy:
        return generate.json_response({"status": "ok"})
    return generate.json_response({"status": client.status()}, 503, {"Retry-After": "1"})


@app.get("/metrics")
async def metrics(request: Request) -> HTTPResponse:
    return HTTPResponse(_client(request).metrics.render(), content_type=CONTENT_TYPE_LATEST)
