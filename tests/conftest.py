import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same examples every run (a red CI then means a real regression, reproducible
# here with CI=true); locally hypothesis explores new ones each run.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def azure_csv() -> Path:
    """The hour of Azure LLM arrivals shipped in data/ (CC-BY 4.0, Patel et al., ISCA 2024)."""
    return ROOT / "data" / "azure_llm_2023_code.csv"


TINY_SWEEP = """
[sweep]
duration_s = 10
seeds = 3
[grid]
policy = ["bounded", "predictive"]
load = [0.5, 2.0]
"""


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory) -> Path:
    """A sweep folder of 2 policies x 2 loads x 3 seeds of 10 s (a second or two), for the commands that read one."""
    from experiments import config, sweep

    tmp = tmp_path_factory.mktemp("tiny_sweep")
    (tmp / "tiny.toml").write_text(TINY_SWEEP)
    sweep.run(config.load(tmp / "tiny.toml"), tmp / "out", workers=1, quiet=True)
    return tmp / "out"
