"""Benchmark of the audit tools on a large ledger (a goal, measured here, never asserted in tests).

    python -m quiesce.tools.audit.bench [--events 1000000] [--ledger URL | --dir DIR] [--json]

Builds (once; reused when the ledger already holds enough events) a SQLite ledger of plausible
save attempts — 37 events each: prepare, commit, publish, resume over four servers — through the
real `Ledger` API in batches, then times:

- `cli_startup_s`: `quiesce --help` in a fresh process (the import cost every command pays);
- `quiesce history --ledger URL --json` (goal: under one second at 1,000,000 events; it reads only
  the `attempts` projection), in a fresh process and in-process (best of three, after imports),
  and the text table in-process;
- `quiesce show ID --json` and `quiesce export --checkpoint ID` of the last attempt (indexed
  reads), in-process;
- `quiesce check --ledger URL --json` over every event (streamed), in-process, as events/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from quiesce.coordinator.protocol import AGENT, MODEL, RESOURCES, route
from quiesce.ledger import AppendItem, Ledger

SERVERS = (("policy_model", MODEL), ("simple_agent", AGENT), ("math_agent", AGENT), ("tools", RESOURCES))
PLAN = (
    ("prepare", (("policy_model", "pause"), ("simple_agent", "prepare"), ("math_agent", "prepare"))),
    ("prepare", (("tools", "prepare"), ("policy_model", "status"))),
    ("commit", (("simple_agent", "commit"), ("math_agent", "commit"), ("policy_model", "commit"))),
    ("commit", (("tools", "commit"),)),
    ("resume", (("tools", "resume"), ("policy_model", "resume"), ("simple_agent", "resume"))),
    ("resume", (("math_agent", "resume"),)),
)
COMPONENT = dict(SERVERS)


def attempt_items(n: int) -> list[AppendItem]:
    """The events of one published save attempt (37)."""
    cid = f"e1-{n:07d}"
    items = [
        AppendItem(
            "attempt.started",
            cid,
            data={"kind": "save", "deadline_ts": 4e9, "participants": [s for s, _ in SERVERS]},
        )
    ]
    current = ""
    k = 0
    for phase, calls in PLAN:
        if phase != current:
            if current:
                items.append(AppendItem("phase.completed", cid, data={"phase": current, "summary": {}}))
            items.append(AppendItem("phase.started", cid, data={"phase": phase}))
            current = phase
        for server, op in calls:
            k += 1
            r = route(COMPONENT[server], op)
            call_id = f"{cid}-{k}"
            items.append(
                AppendItem(
                    "call.sent",
                    cid,
                    server,
                    call_id,
                    {
                        "phase": phase,
                        "method": r.method,
                        "path": r.full_path,
                        "url": "http://h",
                        "timeout_s": 30.0,
                    },
                )
            )
            items.append(
                AppendItem(
                    "call.replied",
                    cid,
                    server,
                    call_id,
                    {"status": 200, "body": {"ok": 1}, "elapsed_s": 0.01},
                )
            )
        if phase == "commit" and len(calls) == 1:
            items.append(AppendItem("attempt.publishing", cid, data={"staging_dir": "/s", "final_dir": "/f"}))
            items.append(
                AppendItem("attempt.published", cid, data={"final_dir": "/f", "manifest_sha256": "0" * 64})
            )
    items.append(AppendItem("phase.completed", cid, data={"phase": current, "summary": {}}))
    items.append(
        AppendItem(
            "attempt.completed", cid, data={"servers": [s for s, _ in SERVERS], "outcome": "published"}
        )
    )
    return items


async def build(url: str, events: int) -> tuple[int, str]:
    """Append attempts until the ledger holds at least `events` events; (head seq, last attempt id)."""
    async with Ledger.open(url, durability="process") as ledger:
        head = await ledger.head()
        seq = head.seq if head is not None else 0
        if seq == 0:
            await ledger.start_epoch(
                {"coordinator": {"host": "bench", "pid": 0, "uuid": "bench"}, "version": "bench"}
            )
            seq = 1
        n = len(await ledger.attempts())
        batch: list[AppendItem] = []
        while seq < events:
            items = attempt_items(n)
            n += 1
            batch.extend(items)
            seq += len(items)
            if len(batch) >= 5000:
                await ledger.append_many(batch)
                batch = []
        if batch:
            await ledger.append_many(batch)
        last = (await ledger.attempts())[-1].checkpoint_id
        head = await ledger.head()
        return (head.seq if head is not None else 0), last


def _time(argv: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "quiesce.tools.cli.main", *argv],
        cwd=Path(__file__).parents[3],  # `-m` finds this tree's `quiesce` by its location
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - start
    if result.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr[-2000:]}")
    return elapsed


def _time_in_process(argv: list[str]) -> float:
    """Seconds `quiesce ARGV` takes once the CLI is imported (stdout discarded)."""
    from quiesce.tools.cli.main import main as cli_main

    with open(os.devnull, "w", encoding="utf-8") as sink, contextlib.redirect_stdout(sink):
        start = time.perf_counter()
        code = cli_main(argv)
        elapsed = time.perf_counter() - start
    if code not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed ({code})")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m quiesce.tools.audit.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--ledger", metavar="URL", help="ledger to use (default: a SQLite file in --dir)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "quiesce-audit-bench")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.ledger is None:
        args.dir.mkdir(parents=True, exist_ok=True)
        args.ledger = f"sqlite+aiosqlite:///{args.dir / f'audit-{args.events}.db'}"
    t0 = time.perf_counter()
    head, last = anyio.run(build, args.ledger, args.events)
    built_s = time.perf_counter() - t0
    out = Path(tempfile.mkdtemp(prefix="quiesce-bench-"))
    history = ["history", "--ledger", args.ledger, "--json"]
    figures: dict[str, Any] = {
        "ledger": args.ledger,
        "events": head,
        "build_s": round(built_s, 2),
        "cli_startup_s": round(_time(["--help"]), 3),
        "history_process_s": round(_time(history), 3),
        "history_in_process_s": round(min(_time_in_process(history) for _ in range(3)), 3),
        "history_text_in_process_s": round(
            min(_time_in_process(["history", "--ledger", args.ledger]) for _ in range(3)), 3
        ),
        "show_in_process_s": round(_time_in_process(["show", last, "--ledger", args.ledger, "--json"]), 3),
        "export_one_in_process_s": round(
            _time_in_process(
                ["export", "--ledger", args.ledger, "--checkpoint", last, "--out", str(out / "b.jsonl")]
            ),
            3,
        ),
    }
    check_s = _time_in_process(["check", "--ledger", args.ledger, "--json"])
    figures["check_all_in_process_s"] = round(check_s, 2)
    figures["check_events_per_s"] = round(head / check_s)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for key, value in figures.items():
            print(f"{key:>26}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
