"""One run of a measure in its own interpreter: ``python -m quiesce.tools.bench.child MODULE:FUNCTION JSON``.

Calls ``quiesce.tools.bench.MODULE.FUNCTION(**json.loads(JSON))`` (awaited under ``anyio.run`` when it is
a coroutine function) and prints one JSON line: the returned dict plus ``peak_rss_mb``, the
peak resident set size of this process (see ``harness.peak_rss_mb``), and ``process_cpu_s``, the
CPU time of its whole life (start-up and imports included).
"""

from __future__ import annotations

import importlib
import inspect
import json
import resource
import sys
from functools import partial
from typing import Any

import anyio

from quiesce.tools.bench.clichild import peak_rss_mb


def main(argv: list[str]) -> int:
    if len(argv) != 2 or ":" not in argv[0]:
        print("usage: python -m quiesce.tools.bench.child MODULE:FUNCTION JSON", file=sys.stderr)
        return 2
    module_name, function_name = argv[0].split(":", 1)
    function = getattr(importlib.import_module(f"quiesce.tools.bench.{module_name}"), function_name)
    params: dict[str, Any] = json.loads(argv[1])
    if inspect.iscoroutinefunction(function):
        result = anyio.run(partial(function, **params))
    else:
        result = function(**params)
    clash = {"peak_rss_mb", "process_cpu_s"} & result.keys()
    if clash:  # a measure's own figure would be overwritten by the child's (measure #9 once was)
        raise SystemExit(
            f"{module_name}:{function_name} returned {sorted(clash)}, which the child sets itself"
        )
    result["peak_rss_mb"] = peak_rss_mb()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["process_cpu_s"] = usage.ru_utime + usage.ru_stime  # this process's whole life, start-up included
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
