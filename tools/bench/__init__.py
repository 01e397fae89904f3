"""Benchmarks: ``python -m tools.bench [--quick] [--only N,...]`` (see ``__main__``).

One module per measure of issue 7, each with ``measure(ctx) -> harness.Result``:

1. ``ledger``  — one recorded call (two durable appends) vs two raw ``sqlite3`` commits;
2. ``remote``  — a recorded remote call (append, loopback HTTP, append) vs DBOS (throwaway venv);
3. ``cycle``   — a save cycle on the 4-server reference cluster, real ledger vs ``NullLedger``;
4. ``scale``   — a save cycle at N = 8 … 512 participants, sequential and parallel fan-out;
5. ``replay``  — replay (projections + chain) of 1,000,000 events vs a raw read;
6. ``recover`` — ``quiesce recover`` after a SIGKILL mid-prepare with 64 touched servers;
7. ``service`` — a save through ``quiesce serve`` vs embedded (issue 22), and a ``/metrics`` scrape.

``harness`` runs every repetition in a fresh process (``child``) and reports median, min, max
and peak RSS; ``report`` writes ``latest.md``. Nothing here asserts a time.
"""
