"""`quiesce sim`: start a reference Gym cluster (tools/gymsim) and write its cluster config."""

from __future__ import annotations

import argparse
from typing import Any

from tools.gymsim import launcher


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="start a reference Gym cluster and write its config",
        description=launcher.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launcher.add_arguments(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    return launcher.run(args)
