"""The `toolq` command: one subcommand per job, each a thin shell over a module."""

from __future__ import annotations

import argparse
import sys


def _cmd_decode(args: argparse.Namespace) -> int:
    from orchestrator.decode_cmd import decode_file

    return decode_file(args.file, sys.stdout, sys.stderr)


def _cmd_fake_model(args: argparse.Namespace) -> int:
    from orchestrator.fake_model.server import serve_forever

    return serve_forever(port=args.port, script=args.script)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toolq", description="Run an LLM agent's tool calls on a Celery fleet.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("decode", help="print each committed item of a recorded SSE body as JSON lines")
    d.add_argument("file")
    d.set_defaults(func=_cmd_decode)

    f = sub.add_parser("fake-model", help="serve a scripted Responses API over SSE on 127.0.0.1")
    f.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    f.add_argument("--script", help="JSON script file; default: the built-in demo conversation")
    f.set_defaults(func=_cmd_fake_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
