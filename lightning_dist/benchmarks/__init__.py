"""Benchmarks run as modules (``python -m lightning_dist.benchmarks.allreduce``); results go to ``bench_results/``."""
