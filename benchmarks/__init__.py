"""Benchmark scripts: run each as ``PYTHONPATH=. python benchmarks/NAME.py``; figures are printed, never asserted."""
