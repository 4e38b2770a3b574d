"""Benchmarks: run as modules, e.g. ``python -m experiments.blocking --out experiments/results/blocking.json``."""
