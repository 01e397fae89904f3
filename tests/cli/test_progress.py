"""Progress of `quiesce checkpoint` on stderr, through real processes against a real cluster:
piped (a batch or SLURM log), one flushed line per phase start, end and failure, seen while the
command still runs; on a terminal (a pty), the live line with the phase, N/M acknowledged, the
elapsed time and the deadline left."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
from pathlib import Path
from typing import Any

import anyio
import httpx

from tests.cli.helpers import child_env, command, json_of, quiesce
from tests.coordinator.helpers import set_faults

LINE = re.compile(
    r"^quiesce \d\d:\d\d:\d\dZ (q[0-9a-f]+-\d+-e\d+-w[0-9a-f]+|e\d+-\d+) (\w+) (started|done|FAILED)\b(.*)$"
)


def _arm(url: str, faults: list[dict[str, Any]]) -> None:
    async def go() -> None:
        async with httpx.AsyncClient() as http:
            await set_faults(http, url, faults)

    anyio.run(go)


def test_piped_checkpoint_writes_a_line_per_phase_as_it_goes(
    config_file: Path, cluster: Any, tmp_path: Path
) -> None:
    # the resources commit answers after 2 s: the command is still running when commit starts
    _arm(cluster.urls["tools"], [{"kind": "delay", "path": "/resources-checkpoint/commit", "seconds": 2.0}])
    process = subprocess.Popen(
        command("checkpoint", "--config", str(config_file), "--json", "--deadline-s", "60"),
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    assert process.stdout is not None
    seen: list[str] = []
    running_at_commit: bool | None = None
    for line in process.stderr:
        seen.append(line.rstrip("\n"))
        if " commit started" in line:
            running_at_commit = process.poll() is None
    document = json_of(subprocess.CompletedProcess(process.args, process.wait(), process.stdout.read(), ""))
    assert process.returncode == 0, seen
    assert running_at_commit is True  # the line was in the log while the command still ran
    parsed = [LINE.match(line) for line in seen]
    assert all(parsed), seen
    steps = [(m.group(2), m.group(3)) for m in parsed if m]
    assert steps == [
        ("prepare", "started"),
        ("prepare", "done"),
        ("commit", "started"),
        ("commit", "done"),
        ("publish", "started"),
        ("publish", "done"),
        ("resume", "started"),
        ("resume", "done"),
    ]
    assert {m.group(1) for m in parsed if m} == {document["checkpoint_id"]}
    done = {m.group(2): m.group(4) for m in parsed if m and m.group(3) == "done"}
    for phase in ("prepare", "commit", "resume"):
        assert done[phase].endswith(": 3/3 acknowledged"), done
    started = next(m.group(4) for m in parsed if m and m.group(2) == "commit")
    assert re.fullmatch(r": 3 servers, deadline in \d+\.\ds", started), started


def test_piped_failure_is_a_line_and_the_rollback_follows(
    config_file: Path, cluster: Any, tmp_path: Path
) -> None:
    _arm(
        cluster.urls["tools"],
        [{"kind": "fail", "path": "/resources-checkpoint/commit", "status": 500, "code": "disk_full"}],
    )
    done = quiesce("checkpoint", "--config", str(config_file), cwd=tmp_path)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if LINE.match(line)]
    steps = [(m.group(2), m.group(3)) for m in map(LINE.match, lines) if m]
    assert steps == [
        ("prepare", "started"),
        ("prepare", "done"),
        ("commit", "started"),
        ("commit", "FAILED"),
        ("rollback", "started"),
        ("rollback", "done"),
    ]
    failed = next(line for line in lines if " FAILED" in line)
    assert "commit FAILED at tools" in failed
    assert "disk_full" in failed
    assert "rollback done" in lines[-1]
    assert "3/3 acknowledged" in lines[-1]
    assert "error:" in done.stderr  # the command's own error message still ends the output


def test_terminal_shows_phase_count_elapsed_and_deadline(
    config_file: Path, cluster: Any, tmp_path: Path
) -> None:
    _arm(cluster.urls["tools"], [{"kind": "delay", "path": "/resources-checkpoint/commit", "seconds": 1.5}])
    main_fd, terminal_fd = pty.openpty()
    process = subprocess.Popen(
        command("checkpoint", "--config", str(config_file), "--deadline-s", "60"),
        cwd=tmp_path,
        env=child_env({"TERM": "xterm", "COLUMNS": "200"}),
        stdout=subprocess.PIPE,
        stderr=terminal_fd,
        text=True,
    )
    os.close(terminal_fd)
    shown = b""
    while True:
        ready, _, _ = select.select([main_fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # the terminal closed: the command ended
                break
            if not chunk:
                break
            shown += chunk
        elif process.poll() is not None:
            break
    os.close(main_fd)
    assert process.wait() == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode("utf-8", "replace"))
    frames = [f for f in re.split(r"[\r\n]", text) if " commit" in f]
    assert frames, text[-2000:]
    live = [f for f in frames if re.search(r"commit · \d/3 acknowledged", f)]
    assert live, frames[-5:]
    assert any(re.search(r"calling tools · \d+\.\ds elapsed · deadline in \d+\.\ds", f) for f in live), live[
        -5:
    ]
    assert not any(LINE.match(f.strip()) for f in frames)  # no plain log lines on a terminal
