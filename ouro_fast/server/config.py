"""ServerConfig: every server setting, read from OURO_FAST_* environment variables.

`sanic ouro_fast.server:app` reads them when the worker starts (never at import),
and `ouro-fast serve` writes its command-line options into the same variables,
so both ways of launching are configured identically.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.config import KV_CACHE_DTYPES
from ..model.quantization import QUANTIZATIONS

ENV_PREFIX = "OURO_FAST_"
# The name the embedded default model (random weights) is served under.
DEFAULT_MODEL_NAME = "ouro-tiny-random"


class ConfigError(ValueError):
    """An environment variable that does not parse, named in the message."""


@dataclass(frozen=True)
class ServerConfig:
    """Server settings; field `x` comes from the variable OURO_FAST_<X upper-cased>."""

    model: str | None = None  # a checkpoint directory; None serves the embedded default
    served_model_name: tuple[str, ...] = ()  # names a request's "model" may use; default: model as given
    dtype: str = "auto"
    quantization: str | None = None  # "fp8": linear weights in float8 e4m3 (model/quantization.py)
    kv_cache_dtype: str = "auto"  # "fp8": K/V in float8 e4m3 (half the KV bytes); auto: the dtype's
    device: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    max_waiting: int = 1024  # requests admitted beyond the running ones; more get 429
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    seed: int = 0
    runner: str = "auto"  # "torch" (reference) or "triton" (kernels + CUDA graphs); auto: triton on CUDA
    cuda_graphs: bool = True
    enable_prefix_caching: bool = True  # reuse cached prompt blocks (every loop plane); evicted LRU
    refill: bool = True  # False: batches drain to their slowest row (for comparisons)
    run_ahead: bool = True  # triton runner: decode-only batches launch before their exits are read
    run_ahead_full_depth: bool = True  # ... also when no row can exit early (hides host work per step)
    run_ahead_depth: int = 1  # launches queued ahead of the one the host reads back (1..3)
    cascade_attention: bool = True  # decode lanes sharing a prompt prefix read its K/V once a step
    cpu_threads: int | None = 1  # torch threads on a CPU device (0: torch's default); 1 leaves a core to HTTP
    compile_threads: int | None = None  # start-up kernel compiles in parallel (None: the CPUs, at most 16)
    chat_template: str | None = None  # a chat template file, or the template text; default: the checkpoint's
    api_key: str | None = None  # when set, /v1/*, /tokenize and /detokenize need "Bearer <key>"
    api_key_file: str | None = None  # a file holding the API key (stripped): keeps it off argv and env
    max_body_bytes: int = 8 << 20
    stream_buffer: int = 1024  # engine steps of output one request may have unsent before it is aborted
    ring_capacity: int = 4096
    # Seconds /health answers 503 on SIGTERM while requests are still served: a balancer notices first.
    drain_delay: float = 5.0
    shutdown_grace: float = 10.0  # seconds in-flight requests get to finish on SIGTERM before abort
    queue_timeout: float = 3600.0  # seconds a request may wait unscheduled; then 503 (running ones: never)
    # Connection bounds (server/connections.py); defaults between uvicorn's, Sanic's and nginx's.
    max_connections: int = 2048  # open connections; more are answered 503 and closed at once
    header_timeout: float = 20.0  # request line + headers, from the connection's or request's start
    body_timeout: float = 60.0  # the whole body, from the end of the headers
    keep_alive_timeout: float = 30.0  # an idle kept-alive connection, between requests
    log_level: str = "INFO"  # of the ouro_fast loggers
    stall_limit: float = 60.0  # seconds an owner iteration may run with requests in flight (then: exit 1)
    # sys.setswitchinterval for the worker, in ms (None: Python's 5 ms): how long the event loop may keep
    # the GIL once the engine-owner thread wants it back (a CUDA wait returned, its next launch to queue).
    gil_switch_ms: float | None = None
    # Test-only fault injection, "STAGE:SEED@TOKENS,...": see engine/faults.py.
    test_faults: str = field(default="", repr=False)
    # Test-only owner faults, "die@SEED,stall@SEED": see owner.parse_owner_faults.
    test_owner_faults: str = field(default="", repr=False)

    def __repr__(self) -> str:
        # The API key never reaches a log line or an error message.
        shown = (f for f in dataclasses.fields(self) if f.repr)
        parts = (f"{f.name}={_redacted(f.name, getattr(self, f.name))!r}" for f in shown)
        return f"ServerConfig({', '.join(parts)})"

    __str__ = __repr__

    @property
    def model_names(self) -> tuple[str, ...]:
        """Served names, the first being the one /v1/models lists first and responses carry."""
        if self.served_model_name:
            return self.served_model_name
        return (self.model or DEFAULT_MODEL_NAME,)

    @property
    def metrics_model_name(self) -> str:
        """The model_name label of /metrics: the first served name, else the checkpoint directory's name
        (a scraper learns no filesystem path)."""
        if self.served_model_name:
            return self.served_model_name[0]
        return (Path(self.model).resolve().name if self.model else None) or DEFAULT_MODEL_NAME

    @property
    def max_in_flight(self) -> int:
        """Requests admitted at once (running + waiting): the engine scheduler's capacity."""
        return self.max_num_seqs + self.max_waiting

    def engine_options(self) -> dict:
        """Keyword arguments of ouro_fast.engine.engine.EngineConfig."""
        names = (
            "model", "dtype", "quantization", "kv_cache_dtype", "device", "max_num_seqs",
            "max_num_batched_tokens", "max_waiting", "max_model_len", "block_size", "kv_cache_bytes",
            "num_kv_blocks", "seed", "runner", "cuda_graphs", "enable_prefix_caching", "refill", "run_ahead",
            "run_ahead_full_depth", "run_ahead_depth", "cascade_attention", "compile_threads", "cpu_threads",
            "test_faults", "queue_timeout",
        )  # fmt: skip
        return {name: getattr(self, name) for name in names}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerConfig:
        """Settings from OURO_FAST_* variables (unset or empty: the default); ConfigError if one is bad."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(env_name(f.name), "").strip()
            if raw:
                values[f.name] = _parse(f.name, f.type, raw)
        if "api_key" in values and "api_key_file" in values:
            raise ConfigError(f"give one of {env_name('api_key')} and {env_name('api_key_file')}, not both")
        config = cls(**values)
        config.check()
        if config.api_key_file is not None:
            config = dataclasses.replace(config, api_key=read_api_key(config.api_key_file))
        return config

    def check(self) -> None:
        """ConfigError naming the first setting out of range."""
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_body_bytes", "stream_buffer")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{env_name(name)} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ConfigError(f"{env_name('max_waiting')} must be >= 0, got {self.max_waiting}")
        if not 2 <= self.ring_capacity <= 1 << 30:
            raise ConfigError(f"{env_name('ring_capacity')} must be in [2, 2**30], got {self.ring_capacity}")
        if self.runner not in ("auto", "torch", "triton"):
            raise ConfigError(f"{env_name('runner')} must be auto, torch or triton, got {self.runner!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"{env_name('dtype')} must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(
                f"{env_name('quantization')} must be {' or '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            choices = " or ".join(KV_CACHE_DTYPES)
            raise ConfigError(f"{env_name('kv_cache_dtype')} must be {choices}, got {self.kv_cache_dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"{env_name('device')} must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(
                f"{env_name('log_level')} must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}"
            )
        if self.chat_template is not None:
            from ..model.chat_template import ChatTemplate, template_source

            try:
                ChatTemplate(template_source(self.chat_template))
            except ValueError as e:
                raise ConfigError(f"{env_name('chat_template')}: {e}") from None
        if self.compile_threads is not None and self.compile_threads < 1:
            raise ConfigError(f"{env_name('compile_threads')} must be >= 1, got {self.compile_threads}")
        if self.test_faults:
            from ..engine.faults import parse_faults

            try:
                parse_faults(self.test_faults)
            except ValueError as e:
                raise ConfigError(f"{env_name('test_faults')}: {e}") from None
        switch = self.gil_switch_ms
        if switch is not None and not 0.01 <= switch <= 1000:
            raise ConfigError(f"{env_name('gil_switch_ms')} must be in [0.01, 1000], got {switch}")
        if self.drain_delay < 0:
            raise ConfigError(f"{env_name('drain_delay')} must be >= 0, got {self.drain_delay}")
        if self.stall_limit <= 0:
            raise ConfigError(f"{env_name('stall_limit')} must be > 0, got {self.stall_limit}")
        for name in ("max_connections", "header_timeout", "body_timeout", "keep_alive_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{env_name(name)} must be > 0, got {getattr(self, name)}")
        if self.shutdown_grace < 0 or self.queue_timeout <= 0:
            raise ConfigError(
                f"{env_name('shutdown_grace')} must be >= 0 and {env_name('queue_timeout')} > 0"
            )


def read_api_key(path: str) -> str:
    """The key in file `path`, surrounding whitespace stripped; ConfigError if unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as e:
        raise ConfigError(f"{env_name('api_key_file')}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{env_name('api_key_file')}: {path} is not UTF-8 text") from None
    if not key:
        raise ConfigError(f"{env_name('api_key_file')}: {path} holds no key")
    return key


def _redacted(name: str, value):
    return "<redacted>" if name == "api_key" and value is not None else value


def listen_address(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """`ouro-fast serve`'s default host and port: OURO_FAST_HOST and OURO_FAST_PORT, else 127.0.0.1:8000."""
    environ = os.environ if environ is None else environ
    port = environ.get(env_name("port"), "").strip()
    try:
        return environ.get(env_name("host"), "").strip() or "127.0.0.1", int(port or 8000)
    except ValueError:
        raise ConfigError(f"{env_name('port')}={port!r} is not a valid int") from None


# Help text of every option (the `ouro-fast serve` flag and its OURO_FAST_* variable).
OPTION_HELP = {
    "model": "checkpoint directory (default: the embedded tiny model with random weights)",
    "served_model_name": "comma-separated names clients may use as 'model' (default: --model as given)",
    "dtype": "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16",
    "quantization": "fp8: the layers' linear weights in float8 e4m3 with a scale per output row, "
    "quantized at load (half the weight bytes; default: the checkpoint's dtype)",
    "kv_cache_dtype": "auto (the K/V cache in --dtype) or fp8: float8 e4m3, saturated at +-448, for half "
    "the KV bytes a token (twice the tokens in the pool; attention reads half as much)",
    "device": "auto, cpu, cuda or cuda:N",
    "max_num_seqs": "requests holding KV at once: rows per engine step",
    "max_num_batched_tokens": "tokens per engine step, prompt chunks included",
    "max_waiting": "requests admitted beyond --max-num-seqs; more get 429",
    "max_model_len": "context length limit (default: the checkpoint's max_position_embeddings)",
    "block_size": "positions per KV block",
    "kv_cache_bytes": "KV pool size in bytes (default: 256 MiB on CPU, 85%% of free GPU memory)",
    "num_kv_blocks": "KV pool size in blocks (overrides --kv-cache-bytes)",
    "seed": "the sampler's seed for unseeded requests",
    "runner": "auto (triton on CUDA, else torch), torch (the reference) or triton (kernels + CUDA graphs)",
    "cuda_graphs": "capture every step shape as a CUDA graph at start-up (triton runner)",
    "enable_prefix_caching": "reuse the K/V of prompt blocks seen before (every loop's plane); "
    "--no-enable-prefix-caching turns it off",
    "refill": "start new rows at every loop boundary; false drains a batch to its slowest row",
    "run_ahead": "let the device drive decode-only batches ahead of the host (triton runner)",
    "run_ahead_full_depth": "run ahead also when no row can exit early",
    "run_ahead_depth": "launches queued ahead of the one the host reads back (1..3)",
    "cascade_attention": "decode lanes that share a prompt prefix read its K/V once a step (triton runner)",
    "cpu_threads": "torch threads on a CPU device (0: torch's default); 1 leaves a core to HTTP",
    "compile_threads": "threads compiling kernels at start-up (default: the CPUs, at most 16)",
    "chat_template": "a chat template file, or the Jinja template itself (default: the checkpoint's)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize",
    "api_key_file": "read the API key from this file (stripped); exclusive with --api-key",
    "max_body_bytes": "largest request body accepted (413 beyond)",
    "stream_buffer": "engine steps of output a client may leave unread before its request is aborted",
    "ring_capacity": "records in the submission ring (rounded up to a power of two)",
    "drain_delay": "seconds /health answers 503 on SIGTERM/SIGINT while requests are still accepted",
    "shutdown_grace": "seconds in-flight requests get to finish on SIGTERM/SIGINT before they are aborted",
    "queue_timeout": "seconds a request may wait before the engine schedules it (then 503); "
    "a running request is never cut",
    "max_connections": "open connections at most; more are answered 503 and closed at once",
    "header_timeout": "seconds for a request line and headers, from the connection's (or request's) start",
    "body_timeout": "seconds for a whole request body, from the end of its headers",
    "keep_alive_timeout": "seconds a kept-alive connection may idle between requests",
    "log_level": "level of the ouro_fast loggers: DEBUG, INFO, WARNING or ERROR",
    "stall_limit": "seconds one engine-owner iteration may run with requests in flight before the "
    "server fails them and exits 1",
    "gil_switch_ms": "the worker's sys.setswitchinterval in ms (default: Python's 5 ms)",
}
_DTYPES = ("auto", "float32", "bfloat16", "float16")


_BOOLS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _parse(name: str, type_name: str, raw: str):
    try:
        if "bool" in type_name:
            if "None" in type_name and raw.lower() == "auto":
                return None
            if raw.lower() not in _BOOLS:
                raise ValueError(raw)
            return _BOOLS[raw.lower()]
        if "tuple" in type_name:
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if "int" in type_name:
            return int(raw)
        if "float" in type_name:
            return float(raw)
    except ValueError:
        raise ConfigError(f"{env_name(name)}={raw!r} is not a valid {type_name}") from None
    return raw
