"""experiments: the ``qlab`` command line and sweeps.

``cli`` (the entry point, ``qlab theory`` and ``qlab simulate``; other packages' commands
register themselves), ``commands`` (``qlab sweep``, ``plot``, ``summary``), ``config``
(a sweep's TOML file) and ``sweep`` (its grid of cells, run and written to parquet).
The TOML files beside them are the shipped sweeps and the ``qlab live`` experiment.
"""
