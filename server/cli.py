"""The `radixlm` console script: `radixlm serve --model smollm2-135m [--port 30000 ...]`.

Every ServerArgs field is a flag (dashes for underscores): `radixlm serve --help` lists them."""

from __future__ import annotations

import argparse
import sys

from radixlm.server.server_args import ServerArgs


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from radixlm.server.scaleout.launch import add_scaleout_args

    ServerArgs.add_cli_args(parser)
    add_scaleout_args(parser)  # --replicas N [--router ...] [--ray-address ...]: Ray Serve replicas
    return parser


def serve_main(argv: list[str] | None = None) -> int:
    parser = _serve_parser(argparse.ArgumentParser(prog="python -m radixlm.server",
                                                   description="Start the RadixLM HTTP server."))
    return _run(parser.parse_args(argv), parser)


def _run(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from radixlm.server import torch_free
    from radixlm.server.launch import serve

    try:
        args = ServerArgs.from_cli(ns)
    except ValueError as e:
        parser.error(str(e))
    if ns.replicas:
        from radixlm.server.scaleout.launch import serve_replicas

        return serve_replicas(args, ns)
    torch_free.block_torch()  # this process is the server's HTTP process (server/torch_free.py)
    return serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixlm", description="RadixLM: structured generation + serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = _serve_parser(commands.add_parser("serve", help="start the HTTP server (OpenAI + native API)"))
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        ns_dict = vars(ns)
        ns_dict.pop("command")
        return _run(argparse.Namespace(**ns_dict), serve)
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
