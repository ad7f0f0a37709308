"""Cursus-py benchmarks: each ``bench/bench_*.py`` module exposes ``run() -> list[dict]``."""
