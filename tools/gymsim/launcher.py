"""`python -m tools.gymsim` / `quiesce sim`: start a reference Gym cluster until SIGINT/SIGTERM.

Binds every server to a free loopback port (or a path prefix on the shared port),
writes the coordinator's cluster config (atomically, only once every server
accepts connections — its presence means "ready"), prints where it is, and shuts
down cleanly on SIGINT or SIGTERM. The control token is read from
`NEMO_GYM_CHECKPOINT_CONTROL_TOKEN`, else `NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN`, at
start; it is never printed or written.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from tools.gymsim.cluster import cluster_config, write_yaml_atomic
from tools.gymsim.host import Host
from tools.gymsim.spec import ClusterSpec, load_spec

DEFAULT_CONFIG_OUT = "quiesce-sim.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", metavar="FILE", help="cluster spec (YAML); default: the seed's example cluster"
    )
    parser.add_argument(
        "--config-out",
        metavar="PATH",
        default=DEFAULT_CONFIG_OUT,
        help=f"where to write the coordinator's cluster config (default: {DEFAULT_CONFIG_OUT})",
    )
    parser.add_argument(
        "--workers",
        metavar="N|NAME=N",
        action="append",
        default=[],
        help="declare N unmanaged workers: for every server (N) or one server (NAME=N); repeatable",
    )
    parser.add_argument("--ledger", metavar="URL", help="ledger URL to put into the written config")
    parser.add_argument("--snapshots", metavar="DIR", help="snapshots folder to put into the written config")
    parser.add_argument("--host", help="loopback address to bind (default from the spec: 127.0.0.1)")


def read_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_ENV_FALLBACK) or None


def build_spec(args: argparse.Namespace) -> ClusterSpec:
    spec = load_spec(args.spec)
    if args.host:
        spec = spec.model_copy(update={"host": args.host})
    for item in args.workers:
        name, _, count = item.rpartition("=")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--workers {item}: expected N or NAME=N with N >= 1")
        spec = spec.with_workers({name: int(count)} if name else int(count))
    return ClusterSpec.model_validate(spec.model_dump())


async def serve(spec: ClusterSpec, args: argparse.Namespace, token: str | None) -> None:
    host = Host(spec, token=token)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, host.stop)

    def started() -> None:
        # Everything built so far (modules, every hosted server) lives as long as the process:
        # frozen, the cyclic GC no longer walks it in each full collection (hundreds of hosted
        # servers make those collections long, and they land in the middle of requests).
        gc.freeze()
        config = cluster_config(spec, host.urls, ledger_url=args.ledger, snapshots_dir=args.snapshots)
        path = write_yaml_atomic(args.config_out, config)
        width = max(len(name) for name in host.urls)
        lines = [f"gymsim: {len(host.urls)} servers running; cluster config written to {path.resolve()}"]
        lines += [f"  {name:<{width}}  {url}" for name, url in host.urls.items()]
        if token is None:
            lines.append(
                f"warning: neither {TOKEN_ENV} nor {TOKEN_ENV_FALLBACK} is set: every control request is 401"
            )
        lines.append("stop with Ctrl-C (SIGINT) or SIGTERM")
        print("\n".join(lines), flush=True)

    await host.serve(on_started=started)
    print("gymsim: stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        spec = build_spec(args)
    except (OSError, ValueError, ValidationError) as exc:
        print(f"error: bad gymsim spec: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(spec, args, read_token()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gymsim", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
