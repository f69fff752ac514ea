"""experiments: the ``qlab`` command line, and (later) grids, cells and executors for sweeps."""
