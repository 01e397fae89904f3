"""Fixtures of the hostile suite: the coordinator tests' cluster fixtures, and filesystems that
really are full or read-only.

`small_fs(size)` mounts a tmpfs of `size` bytes (a disk that fills up) and `read_only(folder)`
remounts one read-only — real mounts, because the tests run as root in CI and permission bits do
not stop root. Both unmount when the test ends; without the right to mount (not root, or a kernel
that refuses), the test is skipped and says why.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.coordinator.conftest import cluster, configure, make_cluster, sqlite_url, token

__all__ = ["cluster", "configure", "make_cluster", "mounts", "sqlite_url", "token"]


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(done.stderr.strip() or f"mount {' '.join(args)} failed")


class Mounts:
    """Mounts made for one test, unmounted (lazily, so a busy one never blocks) at its end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: list[Path] = []

    def small_fs(self, size: int, name: str | None = None) -> Path:
        """A fresh tmpfs of `size` bytes, mounted on a new folder under the test's tmp_path."""
        point = self.root / (name or f"fs-{uuid.uuid4().hex[:8]}")
        point.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a small filesystem needs root (the CI runs the tests as root)")
        try:
            _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(point))
        except OSError as error:
            pytest.skip(f"the kernel refused a tmpfs mount ({error}); cannot make a real full disk")
        self.made.append(point)
        return point

    def read_only(self, point: Path) -> None:
        """Remount a filesystem made by `small_fs` read-only (even root cannot write it then)."""
        try:
            _mount("-o", "remount,ro", str(point))
        except OSError as error:
            pytest.skip(f"the kernel refused a read-only remount ({error})")

    def read_write(self, point: Path) -> None:
        _mount("-o", "remount,rw", str(point))

    def cleanup(self) -> None:
        for point in reversed(self.made):
            subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Mounts]:
    made = Mounts(tmp_path)
    try:
        yield made
    finally:
        made.cleanup()


def fill(folder: Path) -> Path:
    """Fill the filesystem of `folder` to the last byte with one file; returns it (delete it to free)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as handle:
        block = b"\0" * 65536
        for size in (65536, 4096, 1):  # then smaller pieces, to the last byte
            try:
                while handle.write(block[:size]):
                    pass
            except OSError:
                pass
    return filler


Filler = Callable[[Path], Path]
