"""doctor's unit tests run in an empty folder: ./runs is where doctor looks for the newest run."""

import pytest


@pytest.fixture(autouse=True)
def _no_runs_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
