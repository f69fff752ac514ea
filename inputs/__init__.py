"""inputs: how qlab is told what to run, and what it writes at its edges.

- :mod:`inputs.argtypes`: number types for command-line flags (and their bounds, for config keys);
- :mod:`inputs.tomlfiles`: TOML config files read and checked, errors naming the file and key;
- :mod:`inputs.policyflags`: ``--policy``, ``--policy-arg`` and a config's ``[policy_args]``;
- :mod:`inputs.clientflags`: the patience and retry flags and their TOML tables;
- :mod:`inputs.batchflags`: the batching engine's flags (``qlab simulate`` and ``qlab serve``);
- :mod:`inputs.run_axes`: a run's axes by group, declared once (a sweep's cells and [grid]);
- :mod:`inputs.progress`: the progress bar a long command draws;
- :mod:`inputs.atomic`: files written whole or not at all (parquet included).

:mod:`qsim` reads no command line and no config file: the flags and TOML tables the commands
share, and their parsing, are here (``tests/test_layout.py`` checks that qsim imports no argparse
and no TOML reader); each command's own parser is its package's (``experiments``, ``live``). The
layer above qsim: it imports qsim (its flags build qsim's objects) and no other qlab package;
live, analysis and experiments import it.
"""
