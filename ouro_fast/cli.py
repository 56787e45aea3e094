"""The ouro-fast command: make-checkpoint and serve."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ouro-fast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from .model.checkpoints import add_make_checkpoint_args

    add_make_checkpoint_args(sub.add_parser("make-checkpoint", help="write a random-weight Ouro checkpoint"))

    from .server.launch import add_serve_args

    add_serve_args(sub.add_parser("serve", help="start the OpenAI-compatible server"))

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
