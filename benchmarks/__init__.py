"""benchmarks: timing and soak scripts, not part of the installed package.

``bench_qsim`` (the simulator next to SimPy and ciw), ``bench_memory`` (a long run's
peak memory, its records streamed to parquet), ``bench_sweep`` (a sweep's wall time),
``bench_live`` (how fast the gate refuses, how punctual the replayer is), ``soak``
(sustained overload: is anything lost or leaked?) and ``lean`` (their lean HTTP client).
Run each as ``PYTHONPATH=. python benchmarks/NAME.py``; figures are printed, never asserted
(tests/test_benchmarks.py and tests/test_soak.py run them small).
"""
