"""Benchmarks run as modules (``python -m lightning_dist.benchmarks.allreduce``); output: bench_results/."""
