"""``quiesce`` in a process of its own that reports on itself:
``python -m quiesce.tools.bench.clichild OUT ARGS...``.

Runs the CLI's ``main(ARGS)`` — with exactly the CLI's own imports, nothing of the bench — then
writes one JSON object to the file ``OUT``: the exit code, ``peak_rss_mb`` (this process's
``VmHWM``, its own peak, not one inherited from the harness that spawned it) and
``process_cpu_s`` (its whole life, start-up and imports included). The CLI's stdout and stderr
stay its own. A measure that times a command from spawn to exit uses this, so the time is the
command's and not the bench's imports.
"""

from __future__ import annotations

import json
import resource
import sys


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (``VmHWM``; ``ru_maxrss`` as a fallback)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m quiesce.tools.bench.clichild OUT ARGS...", file=sys.stderr)
        return 2
    from quiesce.tools.cli.main import main as quiesce

    code = quiesce(argv[1:])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report = {"exit": code, "peak_rss_mb": peak_rss_mb(), "process_cpu_s": usage.ru_utime + usage.ru_stime}
    with open(argv[0], "w", encoding="utf-8") as out:
        json.dump(report, out)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
