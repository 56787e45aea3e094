"""`ouro-fast serve`: the server from the command line, in one process.

Each option writes the OURO_FAST_* variable that `sanic ouro_fast.server:app`
reads (see config.py), so both launchers share one configuration path; an
option left out keeps the variable's value from the environment, or the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from .config import ConfigError, ServerConfig, env_name, listen_address

# Settings that are not command-line options: test_faults is test-only, set by environment.
_NOT_OPTIONS = frozenset({"test_faults"})
_HELP = {
    "gil_switch_ms": "the worker's sys.setswitchinterval in ms (default: Python's 5 ms)",
    "model": "checkpoint directory (default: the embedded tiny model with random weights)",
    "served_model_name": "comma-separated names clients may use as 'model' (default: --model as given)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize",
    "max_waiting": "requests admitted beyond --max-num-seqs; more get 429",
    "stream_buffer": "engine steps of output a client may leave unread before its request is aborted",
    "shutdown_grace": "seconds in-flight requests get to finish on SIGTERM/SIGINT before they are aborted",
    "max_body_bytes": "largest request body accepted (413 beyond)",
    "chat_template": "a chat template file, or the Jinja template itself (default: the checkpoint's)",
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the serve options to parser and make `serve` its command."""
    host, port = listen_address()
    parser.add_argument(
        "--host", default=host, help="address to listen on; env OURO_FAST_HOST, default 127.0.0.1"
    )
    parser.add_argument(
        "--port", type=int, default=port, help="port to listen on; env OURO_FAST_PORT, default 8000"
    )
    parser.add_argument("--access-log", action="store_true", help="log every request")
    for f in dataclasses.fields(ServerConfig):
        if f.name in _NOT_OPTIONS:
            continue
        default = f.default if f.default not in ((), None) else None
        help_text = _HELP.get(f.name, "")
        help_text += f"{'; ' if help_text else ''}env {env_name(f.name)}" + (
            f", default {default}" if default else ""
        )
        parser.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, default=None, metavar="VALUE", help=help_text
        )
    parser.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT: 0 then, 1 if the model failed to load, 2 on a bad configuration."""
    for f in dataclasses.fields(ServerConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            os.environ[env_name(f.name)] = str(value)
    try:
        config = ServerConfig.from_env()
    except ConfigError as e:
        print(f"ouro-fast serve: {e}", file=sys.stderr)
        return 2
    if config.model is not None and not (Path(config.model) / "config.json").is_file():
        print(
            f"ouro-fast serve: {config.model} is not a checkpoint directory (no config.json)", file=sys.stderr
        )
        return 2
    from .app import app

    app.run(host=args.host, port=args.port, single_process=True, access_log=args.access_log, motd=False)
    client = getattr(app.ctx, "client", None)
    return 1 if client is not None and client.state == "failed" else 0
