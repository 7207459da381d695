"""Every test under tests/cluster/ submits to the local Slurm cluster: the folder marks them ``slurm`` (a module here
sets only its other marks: ``cluster_shared``, ``cluster_profile``, ``slurm_interface``, ``cluster_release``)."""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    # Called for the items of this folder only (a conftest's hooks apply below it), before tests/conftest.py's
    # pytest_collection_modifyitems reads the mark (the lanes, the passes) and before -m selects.
    item.add_marker(pytest.mark.slurm)
