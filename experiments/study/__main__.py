"""``python -m experiments.study ARGS``: ``qlab study ARGS``."""

import sys

from experiments.cli import main

sys.exit(main(["study", *sys.argv[1:]]))
