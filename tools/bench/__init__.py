"""Benchmarks: ``python -m tools.bench.<name>``. They print figures; nothing here asserts a time."""
