"""`python -m quiesce.tools.gymsim` / `quiesce sim`: start a reference Gym cluster until SIGINT/SIGTERM.

Binds every server to a free loopback port (or a path prefix on the shared port),
writes the coordinator's cluster config (atomically, only once every server
accepts connections — its presence means "ready"), prints where it is, and shuts
down cleanly on SIGINT or SIGTERM, removing the config it wrote (unless it was
changed since: then it is left, and the output says so). The control token is read from
`NEMO_GYM_CHECKPOINT_CONTROL_TOKEN`, else `NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN`, at
start; it is never printed or written.

With `json` set in the arguments (`quiesce sim --json`), stdout gets one JSON document once
the cluster is ready — `{"config", "servers": {name: url}, "pid", "token_set"}` — and every
line for people goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.tools.gymsim.cluster import cluster_config, write_yaml_atomic
from quiesce.tools.gymsim.host import Host
from quiesce.tools.gymsim.spec import ClusterSpec, default_v2_spec, load_spec

DEFAULT_CONFIG_OUT = "quiesce-sim.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec",
        metavar="FILE",
        help="the servers to run (YAML, see tools/gymsim/spec.py); default: policy_model, judge"
        " (auxiliary), simple_agent, math_agent (stateless) and tools",
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
        help="make every server (N) or one (NAME=N) report N unmanaged workers, which discovery"
        " refuses — to see a refusal; repeatable",
    )
    parser.add_argument(
        "--ledger",
        metavar="URL",
        help="the ledger the written config names (default sqlite+aiosqlite:///quiesce.db)",
    )
    parser.add_argument(
        "--snapshots",
        metavar="DIR",
        help="the snapshots folder the written config names (default ./checkpoints)",
    )
    parser.add_argument("--host", help="loopback address to bind (default from the spec: 127.0.0.1)")
    parser.add_argument(
        "--plane",
        choices=("v1", "v2"),
        default=None,
        help="without --spec: the default cluster of this control plane — v1 (default) or v2, Gym's"
        " unified /ng-control/v1/checkpoint plane (environment, policy_model, agent, resources)",
    )


def read_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_ENV_FALLBACK) or None


def build_spec(args: argparse.Namespace) -> ClusterSpec:
    plane = getattr(args, "plane", None)
    if plane is not None and args.spec:
        raise ValueError("--plane picks a default cluster; with --spec, set `plane:` per server in the spec")
    spec = default_v2_spec() if plane == "v2" else load_spec(args.spec)
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
    as_json = bool(getattr(args, "json", False))
    people = sys.stderr if as_json else sys.stdout
    written: list[tuple[Path, bytes]] = []

    def started() -> None:
        # Everything built so far (modules, every hosted server) lives as long as the process:
        # frozen, the cyclic GC no longer walks it in each full collection (hundreds of hosted
        # servers make those collections long, and they land in the middle of requests).
        gc.freeze()
        config = cluster_config(spec, host.urls, ledger_url=args.ledger, snapshots_dir=args.snapshots)
        path = write_yaml_atomic(args.config_out, config).resolve()
        written.append((path, path.read_bytes()))
        width = max(len(name) for name in host.urls)
        lines = [f"gymsim: {len(host.urls)} servers running; cluster config written to {path}"]
        lines += [f"  {name:<{width}}  {url}" for name, url in host.urls.items()]
        if token is None:
            lines.append(
                f"warning: neither {TOKEN_ENV} nor {TOKEN_ENV_FALLBACK} is set: every control request is 401"
            )
        lines.append("stop with Ctrl-C (SIGINT) or SIGTERM; the config is removed then")
        print("\n".join(lines), file=people, flush=True)
        if as_json:
            document = {
                "config": str(path),
                "servers": dict(host.urls),
                "pid": os.getpid(),
                "token_set": token is not None,
            }
            print(json.dumps(document, indent=2, sort_keys=True), flush=True)

    try:
        await host.serve(on_started=started)
    finally:
        for path, data in written:
            print(_remove_config(path, data), file=people, flush=True)
    print("gymsim: stopped", file=people, flush=True)


def _remove_config(path: Path, data: bytes) -> str:
    """Remove the config this process wrote at `path`, unless it holds other bytes now (someone
    changed or replaced it: it is theirs). Returns what was done, for the log."""
    try:
        if path.read_bytes() != data:
            return f"gymsim: {path} changed since it was written; left in place"
    except FileNotFoundError:
        return f"gymsim: {path} was already removed"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return f"gymsim: removed {path}"


def run(args: argparse.Namespace) -> int:
    try:
        spec = build_spec(args)
    except (OSError, ValueError, ValidationError) as exc:
        print(f"error: bad gymsim spec: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(spec, args, read_token()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m quiesce.tools.gymsim", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
