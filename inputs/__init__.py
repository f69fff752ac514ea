"""inputs: what every qlab package reads and writes at its edges, and nothing of qlab itself.

- :mod:`inputs.argtypes`: number types for command-line flags (and their bounds, for config keys);
- :mod:`inputs.tomlfiles`: TOML config files read and checked, errors naming the file and key;
- :mod:`inputs.atomic`: files written whole or not at all (parquet included).

Any package may import it; it imports no other qlab package.
"""
