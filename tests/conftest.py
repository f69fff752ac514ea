from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def azure_csv() -> Path:
    """The hour of Azure LLM arrivals shipped in data/ (CC-BY 4.0, Patel et al., ISCA 2024)."""
    return ROOT / "data" / "azure_llm_2023_code.csv"
