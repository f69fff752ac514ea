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
