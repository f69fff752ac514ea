"""experiments: the ``qlab`` command line and sweeps.

``cli`` (the entry point, ``qlab theory`` and ``qlab simulate``; other packages' commands
register themselves), ``commands`` (``qlab sweep``, ``plot``, ``summary``), ``config``
(a sweep's TOML file), ``sweep`` (its grid of cells, run and written to parquet) and the
package ``study`` (``qlab study``: the whole reference study, section by section, written up).
The TOML files beside them are the shipped sweeps and the ``qlab live`` experiment.
"""
