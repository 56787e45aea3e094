"""The Sanic application: routes, listeners, the API-key check and the one error handler.

Importing this module is cheap (no torch, no model): Sanic imports it in its
main process too. The engine is built by the owner thread, started in the
worker's before_server_start listener, and shut down on SIGINT/SIGTERM while the loop still serves
(or in before_server_stop when the server stops itself).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import multiprocessing
import os
import signal
import sys
import time

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sanic import Request, Sanic
from sanic.exceptions import SanicException
from sanic.response import HTTPResponse

from . import generate, protocol
from .config import ServerConfig
from .connections import BoundedSanic, ConnectionLimits, raise_open_files_limit
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

app = BoundedSanic("ouro_fast")
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
    logger.info("configuration: %s", config)  # the API key redacted
    if app.state.workers > 1:
        raise RuntimeError("ouro_fast serves from one Sanic worker (one engine per process): drop --workers")
    apply_gil_switch(config)
    app.config.REQUEST_MAX_SIZE = config.max_body_bytes
    bound_connections(app, config)
    if config.test_faults:
        logger.warning("TEST-ONLY fault injection is on (OURO_FAST_TEST_FAULTS=%s)", config.test_faults)
    if config.test_owner_faults:
        logger.warning(
            "TEST-ONLY owner faults are on (OURO_FAST_TEST_OWNER_FAULTS=%s)", config.test_owner_faults
        )
    app.ctx.config = config
    app.ctx.client = EngineClient(config, asyncio.get_running_loop(), on_failure=lambda: _stop_failed(app))
    app.ctx.client.start(float(os.environ.get(_LAUNCH_ENV) or time.time()))


@app.main_process_start
async def share_failure_flag(app: Sanic) -> None:
    # Set by the worker when the engine fails: `sanic ouro_fast.server:app` then exits 1, as ouro-fast serve.
    app.shared_ctx.engine_failed = multiprocessing.Value("b", 0)


def _stop_failed(app: Sanic) -> None:
    flag = getattr(app.shared_ctx, "engine_failed", None)
    if flag is not None:
        flag.value = 1
    app.stop()


@app.main_process_stop
async def exit_1_after_a_failure(app: Sanic) -> None:
    flag = getattr(app.shared_ctx, "engine_failed", None)
    if flag is not None and flag.value:
        raise SystemExit(1)


def bound_connections(app: Sanic, config: ServerConfig) -> None:
    limits = ConnectionLimits(
        config.max_connections, config.header_timeout, config.body_timeout, config.keep_alive_timeout
    )
    app.ctx.connection_limits = limits
    files = raise_open_files_limit(limits)
    if files < limits.max_connections:
        logger.warning(
            "the open-files limit (%d) is below --max-connections (%d)", files, limits.max_connections
        )


@app.after_server_start
async def take_over_stop_signals(app: Sanic) -> None:
    # Sanic stops the loop on SIGINT/SIGTERM and runs its stop listeners after it; draining here instead,
    # on the running loop, keeps the listener and every stream served until the engine has stopped.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_stop_signal, app)


def _on_stop_signal(app: Sanic) -> None:
    client = app.ctx.client
    if client.stop_requested:
        client.hurry()  # a second signal: abort what is still in flight now
        return
    client.stop_requested = True
    asyncio.ensure_future(_stop_then_exit(app))


async def _stop_then_exit(app: Sanic) -> None:
    await _stop_engine_once(app)
    app.stop(terminate=False)


def _stop_engine_once(app: Sanic) -> asyncio.Future:
    """Drain, let requests finish, abort the rest and join the owner: once, whoever asks first."""
    task = getattr(app.ctx, "engine_stop", None)
    if task is None:
        task = app.ctx.engine_stop = asyncio.ensure_future(_stop_engine(app))
    return task


async def _stop_engine(app: Sanic) -> None:
    client = getattr(app.ctx, "client", None)
    if client is not None:
        client.stop_requested = True
        await client.drain(app.ctx.config.drain_delay)
        await client.shutdown(app.ctx.config.shutdown_grace)


@app.before_server_stop
async def stop_engine(app: Sanic) -> None:
    # Already done after a signal; still needed when the server stops itself after an engine failure.
    await asyncio.shield(_stop_engine_once(app))


@app.on_request
async def assign_request_id(request: Request) -> None:
    request.ctx.request_id = protocol.request_id(request.headers.get("x-request-id"))


@app.on_request
async def check_api_key(request: Request) -> None:
    key = request.app.ctx.config.api_key
    if not key or not request.path.startswith(_PROTECTED_PREFIXES):
        return
    if not _key_matches(request.headers.get("authorization", ""), key):
        raise ApiError(
            401, "a valid API key is required (Authorization: Bearer <key>)", code="invalid_api_key"
        )


def _key_matches(header: str, key: str) -> bool:
    # Sanic keeps undecodable header bytes as surrogates: encoding them back gives the bytes received.
    given = header.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {key}".encode("utf-8", "surrogateescape"))


@app.on_response
async def echo_request_id(request: Request, response: HTTPResponse) -> None:
    # Absent when Sanic refused the request before any middleware ran (a malformed request head).
    request_id = getattr(request.ctx, "request_id", None)
    if request_id is not None:
        response.headers["x-request-id"] = request_id


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


async def _parse(request: Request, parse):
    """parse(the JSON body): validation and chat templates of a large body run off the event loop."""

    def work():
        return parse(protocol.parse_json(request.body))

    return await _client(request).off_loop(len(request.body), work)


@app.post("/v1/completions")
async def completions(request: Request):
    client = _client(request)
    info = client.require_ready()
    req = await _parse(request, lambda body: protocol.parse_completion(body, info))
    return await generate.serve(request, client, req)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request):
    client = _client(request)
    info = client.require_ready()
    template = client.tokenizer.apply_chat_template
    req = await _parse(request, lambda body: protocol.parse_chat(body, info, template))
    return await generate.serve(request, client, req)


@app.get("/v1/models")
async def models(request: Request) -> HTTPResponse:
    return generate.json_response(protocol.models_response(_client(request).require_ready()))


@app.post("/tokenize")
async def tokenize(request: Request) -> HTTPResponse:
    client = _client(request)
    info = client.require_ready()
    template = client.tokenizer.apply_chat_template
    text = await _parse(request, lambda body: protocol.parse_tokenize(body, info, template))
    ids = await client.encode(text)
    return generate.json_response({"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids})


@app.post("/detokenize")
async def detokenize(request: Request) -> HTTPResponse:
    client = _client(request)
    info = client.require_ready()
    ids = await _parse(request, lambda body: protocol.parse_detokenize(body, info))
    return generate.json_response({"prompt": await client.decode(ids)})


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
