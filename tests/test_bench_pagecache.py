"""The bench's cold caches (`tools/bench/pagecache.py`): a file really leaves the page cache, the
residency it reports is the kernel's, and a file the kernel keeps (a tmpfs) is refused, not called
cold."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from quiesce.tools.bench import pagecache
from quiesce.tools.bench.pagecache import COLD_MAX, NotCold, evict, ledger_files, resident

SIZE = 4 << 20


def _written(path: Path) -> Path:
    path.write_bytes(os.urandom(SIZE))
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
    path.read_bytes()  # every page cached
    return path


def test_evict_drops_a_file_from_the_page_cache_and_mincore_sees_it(tmp_path: Path) -> None:
    data = _written(tmp_path / "ledger.db")
    assert resident([data]) == 1.0
    assert evict([data]) <= COLD_MAX
    assert resident([data]) <= COLD_MAX
    with data.open("rb") as handle:  # a quarter read back (readahead stays inside the file's first half)
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        handle.read(SIZE // 4)
    assert 0.25 <= resident([data]) < 0.75


def test_the_ledger_files_are_the_database_its_wal_and_its_shared_index(tmp_path: Path) -> None:
    database = _written(tmp_path / "ledger.db")
    wal = _written(tmp_path / "ledger.db-wal")
    assert ledger_files(database) == [database, wal]
    evict(ledger_files(database))
    assert resident([database, wal]) <= COLD_MAX
    empty = tmp_path / "empty"
    empty.touch()
    assert resident([empty]) == 0.0


def test_a_file_the_kernel_keeps_is_refused_as_not_cold() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (a tmpfs) on this machine")
    path = shm / f"quiesce-pagecache-{os.getpid()}"
    try:
        path.write_bytes(b"x" * mmap.PAGESIZE * 16)
        with pytest.raises(NotCold, match="stayed in the page cache"):
            evict([path])
    finally:
        path.unlink(missing_ok=True)


def test_pages_counts_whole_pages(tmp_path: Path) -> None:
    path = tmp_path / "odd"
    path.write_bytes(b"y" * (mmap.PAGESIZE * 3 + 1))
    path.read_bytes()
    assert pagecache._pages(path) == (4, 4)
