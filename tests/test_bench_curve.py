"""Measure #12's judged save ratio (`tools/bench/curve.py`): the ledger's own CPU per save at the
largest size over the smallest, every run's saves pooled, with a bootstrap interval that brackets it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from quiesce.tools.bench.curve import save_ratio


def _runs(ledger_s: float, rng: random.Random, runs: int = 2, saves: int = 60) -> list[dict[str, Any]]:
    """Runs whose null side costs ~30 ms CPU per save, whose ledger counts ``ledger_s`` per save with
    ±20% of noise, and whose real side costs that much more than the null side."""
    out = []
    for _ in range(runs):
        null = [0.030 * rng.uniform(0.97, 1.03) for _ in range(saves)]
        ledger = [ledger_s * rng.uniform(0.8, 1.2) for _ in range(saves)]
        real = [0.030 * rng.uniform(0.97, 1.03) + x for x in ledger]
        out.append({"save_cpu_samples": {"real": real, "null": null, "ledger": ledger}})
    return out


def test_the_ratio_of_pooled_ledger_cpu_and_its_interval() -> None:
    rng = random.Random(11)
    low, high = _runs(0.004, rng), _runs(0.006, rng)
    value, lo, hi = save_ratio(low, high)
    assert 1.3 < value < 1.7  # 6 ms over 4 ms, within the noise
    assert lo <= value <= hi
    assert lo < 1.5 < hi
    flat, flat_lo, flat_hi = save_ratio(low, _runs(0.004, rng))
    assert flat_lo < 1.0 < flat_hi
    assert flat < 1.3
    assert save_ratio(low, high) == (value, lo, hi)  # a fixed seed: the same samples, the same interval


def test_a_ledger_cpu_at_or_below_zero_still_gives_a_number() -> None:
    rng = random.Random(2)
    none = [{"save_cpu_samples": {"real": [0.03, 0.03], "null": [0.03, 0.03], "ledger": [0.0, 0.0]}}]
    value, lo, hi = save_ratio(none, _runs(0.004, rng, runs=1, saves=2))
    assert value > 1000
    assert lo <= value <= hi


def test_the_interval_covers_the_spread_between_runs() -> None:
    """Two runs of one size whose saves sit apart (a run effect): resampling saves alone would give a
    tight interval around the pooled ratio; resampling runs first spans what either run alone says."""
    rng = random.Random(3)
    low = _runs(0.005, rng, runs=2)
    apart = _runs(0.005, rng, runs=1) + _runs(0.0065, rng, runs=1)  # 5 ms and 6.5 ms per save
    value, lo, hi = save_ratio(low, apart)
    assert lo <= value <= hi
    assert lo < 1.05  # as low as the first run alone (1.0)
    assert hi > 1.25  # as high as the second run alone (1.3)


def test_runs_are_resampled_as_pairs() -> None:
    """The i-th runs of both sizes shared a process and a cluster: a run effect that moves both alike
    (5 ms in one run, 6.5 ms in the other, at either size) leaves their ratio at 1.0, and the
    interval stays near it (about 0.94-1.13 from the saves' own noise) — drawing each size's runs
    on their own would mix a 5 ms run with a 6.5 ms one and span 0.78-1.36."""
    rng = random.Random(4)
    low = _runs(0.005, rng, runs=1) + _runs(0.0065, rng, runs=1)
    high = _runs(0.005, rng, runs=1) + _runs(0.0065, rng, runs=1)
    value, lo, hi = save_ratio(low, high)
    assert 0.88 < lo <= value <= hi < 1.2
    with pytest.raises(ValueError, match="not paired"):
        save_ratio(low, high[:1])
