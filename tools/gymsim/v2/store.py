"""Manifest-last storage of one v2 participant (Gym's `_checkpoint/store.py`).

Layout: `<checkpoint_dir>/gym/<kind>/<instance>/records-<sha256>.jsonl` + `manifest.json`.

Rules:
- The records file is written under a temporary `.records.jsonl.*` name, fsynced, and renamed to the
  name of its own sha256 (over the exact bytes, one `json.dumps` line per record).
- `manifest.json` (sorted keys, indent 1) is published last, by a hard link from a synced temporary
  file: it is created once and never replaced; the folder is fsynced after it.
- A folder that already holds an identical manifest is answered with it as is; a different one is a
  422 `invalid_checkpoint_state`.
- A `WriteStop` that was stopped (a resume) keeps the manifest from ever being published.
- The reader checks schema 1, kind, instance, the records file's name (or the legacy `records.jsonl`),
  its digest and its line count before any record is handed out (422 on any mismatch).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from quiesce.coordinator.durable import fsync_dir
from quiesce.coordinator.protocol_v2 import (
    INVALID_CHECKPOINT_STATE,
    LEGACY_RECORDS,
    MANIFEST,
    RECORDS_PATTERN,
    EpisodeId,
    manifest_bytes,
    participant_dir,
    record_line,
    records_file_name,
)
from quiesce.tools.gymsim.v2.errors import refuse


class WriteStop:
    """Stops a write before it publishes: `stop()` waits for a publication under way, then no later
    one happens (the writer checks `stopped` under the same lock right before its hard link)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopped = False

    def stop(self) -> None:
        with self.lock:
            self.stopped = True


class WriteStopped(Exception):
    """The write was stopped by a resume; nothing was published."""


def _write_synced(path: Path, chunks: Iterable[bytes]) -> str:
    """Write `chunks` to `path` (created new), fsync it, return the sha256 of what was written."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for chunk in chunks:
            digest.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest()


def write_state(
    checkpoint_dir: str,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any],
    stop: WriteStop,
) -> dict[str, Any]:
    """Write a participant's records and then its manifest; returns the manifest (blocking: run it in
    a thread). Raises `ControlRejection(invalid_checkpoint_state)` on I/O errors or a different
    manifest already there, `WriteStopped` when a resume stopped it."""
    folder = Path(checkpoint_dir) / participant_dir(kind, instance)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".records.jsonl.{uuid.uuid4().hex}"
        sha = _write_synced(tmp, (record_line(r) for r in records))
        name = records_file_name(sha)
        os.replace(tmp, folder / name)
        manifest: dict[str, Any] = {
            **extra,
            "schema_version": 1,
            "kind": kind,
            "instance": instance,
            "checkpoint_id": checkpoint_id,
            "records_file": name,
            "records_sha256": sha,
            "record_count": len(records),
        }
        data = manifest_bytes(manifest)
        tmp_manifest = folder / f".manifest.json.{uuid.uuid4().hex}"
        _write_synced(tmp_manifest, [data])
        fsync_dir(folder)
        try:
            with stop.lock:
                if stop.stopped:
                    raise WriteStopped("resumed before the manifest was published")
                try:
                    os.link(tmp_manifest, folder / MANIFEST)
                except FileExistsError:
                    existing = (folder / MANIFEST).read_bytes()
                    if existing != data:
                        raise refuse(
                            INVALID_CHECKPOINT_STATE,
                            f"{participant_dir(kind, instance)} already holds a different commit",
                        ) from None
                    loaded: dict[str, Any] = json.loads(existing)
                    return loaded
        finally:
            tmp_manifest.unlink(missing_ok=True)
        fsync_dir(folder)
        return manifest
    except OSError as exc:
        raise refuse(
            INVALID_CHECKPOINT_STATE, f"cannot write {participant_dir(kind, instance)}: {exc}"
        ) from exc


def _bad(kind: str, instance: str, what: str) -> Exception:
    return refuse(INVALID_CHECKPOINT_STATE, f"{participant_dir(kind, instance)}: {what}")


def read_state(
    checkpoint_dir: str,
    *,
    kind: str,
    instance: str,
    select: Callable[[str], bool],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The manifest and the records whose capture key `select` keeps, after checking the manifest and
    the records file whole (blocking: run it in a thread). Any mismatch → 422."""
    folder = Path(checkpoint_dir) / participant_dir(kind, instance)
    try:
        manifest = json.loads((folder / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise _bad(kind, instance, "no manifest.json") from None
    except (OSError, ValueError) as exc:
        raise _bad(kind, instance, f"unreadable manifest.json: {exc}") from exc
    if not isinstance(manifest, dict):
        raise _bad(kind, instance, "manifest.json is not an object")
    if manifest.get("schema_version") != 1:
        raise _bad(kind, instance, f"unknown schema_version {manifest.get('schema_version')!r}")
    if manifest.get("kind") != kind or manifest.get("instance") != instance:
        raise _bad(kind, instance, f"manifest names {manifest.get('kind')}/{manifest.get('instance')}")
    name = manifest.get("records_file")
    if not isinstance(name, str) or not (RECORDS_PATTERN.match(name) or name == LEGACY_RECORDS):
        raise _bad(kind, instance, f"bad records_file {name!r}")
    try:
        data = (folder / name).read_bytes()
    except OSError as exc:
        raise _bad(kind, instance, f"cannot read {name}: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != manifest.get("records_sha256"):
        raise _bad(kind, instance, f"{name} does not match records_sha256")
    lines = data.splitlines()
    if len(lines) != manifest.get("record_count"):
        raise _bad(
            kind,
            instance,
            f"{name} holds {len(lines)} records, the manifest says {manifest.get('record_count')}",
        )
    kept: list[dict[str, Any]] = []
    for line in lines:
        try:
            record = json.loads(line)
            key = EpisodeId.model_validate(record["episode_id"]).capture_key
        except (ValueError, KeyError, TypeError) as exc:
            raise _bad(kind, instance, f"a record has no valid episode_id: {exc}") from exc
        if select(key):
            kept.append(record)
    return manifest, kept
