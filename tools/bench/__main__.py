"""Run the benchmarks: ``python -m quiesce.tools.bench [--quick] [--only N,...] [--runs R] [--out DIR]
[--readme]``.

A full run (every measure, neither ``--quick`` nor ``--only``) writes ``DIR/latest.json`` and
``DIR/latest.md`` (default ``bench-results/``): one row per measure with its median [min–max]
over the runs, the baseline measured in the same run, the goal and whether it was met, the peak
RSS, each side's settings, the commit and the machine. ``--quick`` (tiny sizes, one run per
measure: a smoke check of the harness, not a measurement) writes ``quick.*`` instead, and
``--only 3,5`` writes ``only-3,5.*``: neither ever replaces ``latest.*``. ``--readme`` then
rewrites README.md's benchmark table from ``DIR/latest.json`` (``quiesce.tools.bench.readme``).
``--only N,... --splice`` also puts the measures of that run into ``DIR/latest.json`` (and
``latest.md``) in place of theirs, each marked with the command, commit and start of the run it
came from (``source``), which the report and README's table name: a measure added or changed
since the last full run gets its row without rerunning every other measure.
Exit status: 0 when every selected measure ran (goals met or not), 1 when one failed to run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from quiesce.tools.bench import harness
from quiesce.tools.bench.harness import REPO_ROOT, Context, Result, child_env, commit, machine
from quiesce.tools.bench.load import LOADED_SHARE, Load, LoadWatch, merged
from quiesce.tools.bench.report import render_markdown

#: measure number → (module, title); every module has ``measure(ctx) -> Result``.
MEASURES: dict[int, tuple[str, str]] = {
    1: ("ledger", "recorded call = two durable appends"),
    2: ("remote", "recorded remote call vs DBOS"),
    3: ("cycle", "save cycle, real vs null ledger, planes v1 and v2"),
    4: ("scale", "save and discovery at N distinct origins vs a bare client"),
    5: ("replay", "replay 1M events"),
    6: ("recover", "quiesce recover after SIGKILL"),
    7: ("postgres", "PostgreSQL: recorded call, save, lease"),
    8: ("growth", "quiesce checkpoint from a cold process: fresh vs 1M-event ledger"),
    9: ("durability", "durability process vs full"),
    10: ("service", "quiesce serve: save through the service vs embedded; /metrics scrape"),
    11: ("gymscale", "v2 save at N distinct origins vs Gym's own stateless coordination"),
    12: ("curve", "cost growth: commands and the save's ledger CPU at 0 / 10k / 100k / 1M events"),
    13: ("rollouts", "one rollout's lineage from a cold process, and the lineage fold, 1M events"),
    14: ("rlbackend", "NeMo RL backend: a snapshot through quiesce.rl vs the embedded coordinator"),
}


def output_stem(quick: bool, only: str | None) -> str:
    """The file name (without suffix) a run writes: only a full run writes ``latest``."""
    if quick:
        return "quick"
    if only:
        return "only-" + ",".join(str(n) for n in _parse_only(only))
    return "latest"


def _parse_only(text: str | None) -> list[int]:
    if not text:
        return sorted(MEASURES)
    chosen = []
    for part in text.split(","):
        number = int(part.strip())
        if number not in MEASURES:
            raise argparse.ArgumentTypeError(f"no measure {number}; choose from {sorted(MEASURES)}")
        chosen.append(number)
    return sorted(set(chosen))


def splice(latest: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """``latest`` with the measures of ``run`` (an ``--only`` run) in place of its own (added when
    new; ordered by id), each marked with the run's ``source``: command, commit, start, load."""
    source = {
        "command": run["command"],
        "commit": run["commit"],
        "started": run["started"],
        "runs": run["runs"],
        "load_avg_at_start": run["machine"].get("load_avg_at_start"),
        "cpu": f"{run['machine'].get('cpu')}, {run['machine'].get('cores')} cores",
    }
    replaced = {m["id"]: {**m, "source": source} for m in run["measures"]}
    kept = [m for m in latest["measures"] if m["id"] not in replaced]
    return {**latest, "measures": sorted([*kept, *replaced.values()], key=lambda m: int(m["id"]))}


def compile_bytecode(prefix: Path) -> str:
    """Give every child process quiesce's compiled bytecode, as an installed package has it.

    A user's ``pip install`` leaves ``.pyc`` files; a machine with ``PYTHONDONTWRITEBYTECODE``
    set (this one's CI image does) would make every cold process — ``quiesce recover``,
    ``quiesce checkpoint`` — compile all of quiesce from source first, which no user pays twice.
    The children write and read bytecode under ``prefix`` (``PYTHONPYCACHEPREFIX``, so the
    checkout stays clean); it is compiled here once, before any measure, untimed. Returns the
    setting as ``latest.md`` states it.
    """
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    folders = [str(REPO_ROOT / name) for name in ("coordinator", "ledger", "tools")]
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", *folders],
        env=child_env(), check=True, stdout=subprocess.DEVNULL, cwd=str(REPO_ROOT),
    )  # fmt: skip
    return f"compiled once, before the measures, into {prefix.name}/ (PYTHONPYCACHEPREFIX)"


def judge_load(result: Result, runs: list[dict[str, Any]], whole: Load) -> None:
    """Attach ``runs`` (the measure's raw child runs) and the load they ran under to ``result``;
    a measure any of whose runs was loaded (``Load.loaded``: other processes took more than
    ``LOADED_SHARE`` of the cores) is not judged — ``met`` becomes None, and a note says why and
    what the verdict would have been. A measure without child runs is judged by ``whole``."""
    result.raw = runs
    loads = [run["load"] for run in runs if "load" in run] or [whole.to_json()]
    result.load = merged(loads)
    loaded = [i + 1 for i, load in enumerate(loads) if load.get("loaded")]
    if not loaded:
        return
    worst = max(float(load["foreign_cores"]) for load in loads if load.get("loaded"))
    would = {True: "met", False: "missed", None: "not judged"}[result.met]
    result.notes.insert(
        0,
        f"NOT JUDGED: the machine was loaded — other processes took up to {worst:.2f} of its"
        f" {loads[0]['cores']} cores during run(s) {', '.join(map(str, loaded))} (more than"
        f" {LOADED_SHARE:.0%} of the cores; tools/bench/load.py), so these figures claim no goal"
        f" (the goal would read: {would}). Rerun on a quiet machine",
    )
    result.met = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m quiesce.tools.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run: a smoke check")
    parser.add_argument(
        "--only", type=str, default=None, help=f"comma-separated measure numbers (1-{max(MEASURES)})"
    )
    parser.add_argument("--runs", type=int, default=None, help="runs per measure (default 5; --quick 1)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results", help="output folder")
    parser.add_argument("--cache", type=Path, default=None, help="kept between runs (default OUT/.cache)")
    parser.add_argument(
        "--dbos-venv", type=Path, default=None, help="create or reuse the DBOS venv here (default: temp)"
    )
    parser.add_argument(
        "--sizes", type=str, default=None, help="measures 4 and 11: the N values, e.g. 8,64,512"
    )
    parser.add_argument(
        "--splice",
        action="store_true",
        help="with --only: put these measures into OUT/latest.json, marked with this run's source",
    )
    parser.add_argument(
        "--readme",
        action="store_true",
        help="then rewrite README.md's benchmark table from OUT/latest.json",
    )
    args = parser.parse_args(argv)
    try:
        only = _parse_only(args.only)
    except (ValueError, argparse.ArgumentTypeError) as error:
        parser.error(str(error))
    if args.splice and (args.quick or not args.only):
        parser.error("--splice needs --only and a full (not --quick) run")
    runs = args.runs if args.runs is not None else (1 if args.quick else 5)
    out: Path = args.out.resolve()  # children run in other folders: every path they get is absolute
    out.mkdir(parents=True, exist_ok=True)
    cache: Path = args.cache.resolve() if args.cache else out / ".cache"
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="quiesce-bench-", dir=out))
    try:
        sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else ()
    except ValueError:
        parser.error(f"--sizes: not a list of numbers: {args.sizes}")
    if any(n < 5 for n in sizes):
        parser.error("--sizes: every N must be at least 5")
    ctx = Context(quick=args.quick, runs=runs, work=work, cache=cache, dbos_venv=args.dbos_venv, sizes=sizes)
    bytecode = compile_bytecode(cache / "pycache")
    started = time.time()
    results: list[Result] = []
    failed = False
    code_commit = commit()
    try:
        info = machine(work)
        info["bytecode"] = bytecode
        for number in only:
            module_name, title = MEASURES[number]
            ctx.log(f"measure {number}: {title}")
            begun = time.perf_counter()
            harness.RUNS.clear()
            try:
                with LoadWatch() as watch:
                    module = importlib.import_module(f"quiesce.tools.bench.{module_name}")
                    result: Result = module.measure(ctx)
            except Exception as error:
                failed = True
                ctx.log(traceback.format_exc())
                result = Result(number, title, "", status="error", reason=f"{type(error).__name__}: {error}")
            else:
                assert watch.load is not None
                judge_load(result, list(harness.RUNS), watch.load)
            results.append(result)
            verdict = {True: "met", False: "MISSED", None: result.status}[result.met]
            ctx.log(f"measure {number}: {result.value or result.reason} -> {verdict}"
                    f" ({time.perf_counter() - begun:.0f} s)")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    document: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "quick": args.quick,
        "runs": runs,
        "command": " ".join(["python -m quiesce.tools.bench", *(argv if argv is not None else sys.argv[1:])]),
        "commit": code_commit,
        "machine": info,
        "measures": [r.to_json() for r in results],
    }
    stem = output_stem(args.quick, args.only)
    (out / f"{stem}.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text(render_markdown(document), encoding="utf-8")
    ctx.log(f"wrote {out / f'{stem}.md'} and {out / f'{stem}.json'}")
    if args.splice:
        latest = json.loads((out / "latest.json").read_text(encoding="utf-8"))
        spliced = splice(latest, document)
        (out / "latest.json").write_text(json.dumps(spliced, indent=2) + "\n", encoding="utf-8")
        (out / "latest.md").write_text(render_markdown(spliced), encoding="utf-8")
        ids = ", ".join(str(m["id"]) for m in document["measures"])
        ctx.log(f"spliced measures {ids} into {out / 'latest.json'}")
    if args.readme:
        from quiesce.tools.bench.readme import update_readme

        update_readme(out / "latest.json")
        ctx.log(f"regenerated README.md's benchmark table from {out / 'latest.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
