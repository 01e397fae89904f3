"""`quiesce serve --config C [--listen HOST:PORT] [--advertise URL] [--allow-host NAME[:PORT]]... [--json]`
— the ledger as a service.

Serves HTTP API v1 (`/docs` for the OpenAPI page), server-sent event streams, `/metrics`,
`/healthz`, `/readyz` and a live page at `/` until SIGTERM or Ctrl-C; see `quiesce.tools.serve`. The API
token comes from `QUIESCE_API_TOKEN` (required when listening beyond loopback), the Gym control
token from the config's `token_env`, as for every command. On a PostgreSQL ledger a second
`quiesce serve` on the same config is a standby: it answers 503 naming the active one, and takes
over when that one's lease expires. It answers only to the Host names of its own address (and
`--allow-host` / `QUIESCE_ALLOW_HOSTS`), and takes state changes only as JSON from its own origin.
Once serving (or waiting as a standby) it prints where, on
stdout: `serving http://HOST:PORT (ready)`, or with `--json` one line `{"listening": URL, "state",
"auth", "pid"}`. Exit 0 after a clean stop, 1 when the service failed, 2 on bad usage or config.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.coordinator import load_config, resolve_token
from quiesce.ledger.errors import require_extra
from quiesce.tools.cli.flags import add_config


def register(subparsers: Any) -> None:
    from quiesce.tools.serve.listen import DEFAULT_LISTEN

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="HTTP API v1, event streams, /metrics, /readyz and a live page",
        description="Serve the coordinator over HTTP: API v1, live events, Prometheus metrics, a standby "
        "on PostgreSQL.",
    )
    add_config(parser)
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default=DEFAULT_LISTEN,
        help=f"address to listen on (default {DEFAULT_LISTEN}; port 0 picks a free one)",
    )
    parser.add_argument(
        "--advertise",
        metavar="URL",
        default=None,
        help="the address a standby names for this service (default: http://HOST:PORT as bound)",
    )
    parser.add_argument(
        "--allow-host",
        metavar="NAME[:PORT]",
        action="append",
        default=[],
        help="another name the service answers to in the Host header (repeatable; also"
        " $QUIESCE_ALLOW_HOSTS, comma-separated): any other name is refused (421), as a page of another"
        " site rebound to this address would use",
    )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from quiesce.tools.serve.listen import parse_listen

    config = load_config(args.config)
    parse_listen(args.listen)  # bad usage before anything is opened
    for module in ("prometheus_client", "fastapi_offline"):  # checked before the port is bound
        require_extra(module, extra="serve", needed_by="quiesce serve")
    from quiesce.tools.serve.runner import serve

    resolve_token(config)  # no control token: a config error now, not at the first request
    return anyio.run(
        lambda: serve(
            config,
            args.listen,
            advertise=args.advertise,
            as_json=args.json,
            config_path=args.config,
            allow_hosts=args.allow_host,
        )
    )
