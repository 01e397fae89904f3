"""Benchmarks: ``python -m quiesce.tools.bench [--quick] [--only N,...] [--readme]`` (see ``__main__``).

One module per measure, each with ``measure(ctx) -> harness.Result``; both sides of every ratio
run interleaved in the same run, in a rotating order, and each states its settings:

1. ``ledger``     — one recorded call (two durable appends) vs two raw ``sqlite3`` commits;
2. ``remote``     — a recorded remote call vs a DBOS workflow of one step, at equal durability
   (fsync per step; fsync off) and with the same HTTP client code or no request;
3. ``cycle``      — a 4-server save with rollouts (v1) or episodes (v2) running, real ledger vs
   ``NullLedger``, on both planes, each against its own baseline: % and ms;
4. ``scale``      — a save and a discovery at N distinct origins (4 server processes, rollouts
   running), reusing connections and on fresh ones, vs a bare client's same requests
   (``bareclient``);
5. ``replay``     — replay of 1,000,000 events of recorded real cycles (``history``) vs a raw read;
6. ``recover``    — ``quiesce recover`` after a SIGKILL mid-prepare, 64 touched servers, on the
   1M-event history and on a fresh ledger;
7. ``postgres``   — a recorded call vs raw asyncpg, a save real vs null ledger, the lease renewal;
8. ``growth``     — ``quiesce checkpoint`` from a cold process, fresh vs 1M-event ledger;
9. ``durability`` — ``durability: process`` vs ``full``, side by side;
10. ``service``   — a save through ``quiesce serve`` vs embedded, and a ``/metrics`` scrape;
11. ``gymscale``  — a v2 save at 8, 64, 512 distinct origins (episodes running) vs Gym's own stateless
    coordination (``gymcoord``), reusing connections and on fresh ones;
12. ``curve``     — cost growth with the history: cold-process ``history``, ``history --limit 20``,
    ``status``, ``show latest``, ``checkpoint``, ``recover`` and the save's ledger CPU (counted where
    the ledger's code runs: ``ledgercpu``) at 0, 10k, 100k and 1M events of two shapes of recorded
    cycles. Cold passes (``pagecache``) of 5, 6 and 8
    drop the ledger from the page cache first.

``harness`` runs every repetition in a fresh process (``child``) and reports median, min, max
and peak RSS; ``report`` writes ``latest.md``; ``readme`` makes README's table from
``latest.json``. Nothing here asserts a time.
"""
