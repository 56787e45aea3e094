"""`ouro-fast serve`: the server from the command line, in one process.

Each option writes the OURO_FAST_* variable that `sanic ouro_fast.server:app`
reads (see config.py), so both launchers share one configuration path; an
option left out keeps the variable's value from the environment, or the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

from .config import OPTION_HELP, ConfigError, ServerConfig, env_name, listen_address

# Settings that are not command-line options: the test-only fault hooks, set by environment.
_NOT_OPTIONS = frozenset({"test_faults", "test_owner_faults"})


def _metavar(f: dataclasses.Field) -> str:
    kind = str(f.type)
    if "bool" in kind:
        return "BOOL"
    if f.name in ("model", "chat_template", "api_key_file"):
        return "TEMPLATE" if f.name == "chat_template" else "PATH"
    if "int" in kind:
        return "N"
    if "float" in kind:
        seconds = f.name in ("drain_delay", "shutdown_grace", "stall_limit") or f.name.endswith("_timeout")
        return "SECONDS" if seconds else "X"
    return "NAME" if f.name != "api_key" else "KEY"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the serve options to parser and make `serve` its command."""
    host, port = listen_address()
    parser.add_argument(
        "--host",
        default=host,
        metavar="ADDRESS",
        help="address to listen on; env OURO_FAST_HOST, default 127.0.0.1",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=port,
        metavar="N",
        help="port to listen on; env OURO_FAST_PORT, default 8000",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request")
    for f in dataclasses.fields(ServerConfig):
        if f.name in _NOT_OPTIONS:
            continue
        default = f.default if f.default not in ((), None, "") else None
        help_text = OPTION_HELP[f.name] + f"; env {env_name(f.name)}"
        if default is not None:
            help_text += f", default {default}"
        flag = "--" + f.name.replace("_", "-")
        if "bool" in str(f.type):
            no_flag = "--no-" + flag[2:]
            parser.add_argument(flag, no_flag, dest=f.name, action=_BoolOption, nargs="?", default=None,
                                metavar=_metavar(f), help=help_text)  # fmt: skip
            continue
        parser.add_argument(flag, dest=f.name, default=None, metavar=_metavar(f), help=help_text)
    parser.set_defaults(func=serve)


class _BoolOption(argparse.Action):
    """A boolean option as vLLM spells them: --x (true), --no-x (false), or --x BOOL."""

    def __call__(self, parser, namespace, value, option_string=None):
        if option_string.startswith("--no-"):
            if value is not None:
                parser.error(f"{option_string} takes no value")
            value = "false"
        setattr(namespace, self.dest, "true" if value is None else value)


def serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT: 0 then; 1 if the model failed to load or the engine owner thread died
    or stalled (the server stops itself); 2 on a bad configuration."""
    for f in dataclasses.fields(ServerConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            os.environ[env_name(f.name)] = str(value)
    try:
        config = ServerConfig.from_env()
    except ConfigError as e:
        print(f"ouro-fast serve: {_name_flags(str(e), args)}", file=sys.stderr)
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


def _name_flags(message: str, args: argparse.Namespace) -> str:
    """The message with each option given on the command line named by its flag, not its variable."""
    for f in dataclasses.fields(ServerConfig):
        if getattr(args, f.name, None) is not None:
            # Whole names only: OURO_FAST_API_KEY must not rename the start of OURO_FAST_API_KEY_FILE.
            message = re.sub(rf"\b{env_name(f.name)}\b", "--" + f.name.replace("_", "-"), message)
    return message
