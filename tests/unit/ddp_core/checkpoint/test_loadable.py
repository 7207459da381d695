"""The first save of an attempt refuses a state that ``torch.load(weights_only=True)`` would reject, naming the key,
on every rank (``loadable``): found at save time, while older checkpoints still exist, not at resume."""

import numpy as np
import pytest
import torch

from ddp_core.checkpoint import loadable, store
from ddp_core.errors import DdpJobError


def good_state():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "per_rank": [{"data": {"i": 3}}]}


def test_a_state_that_loads_passes_and_one_that_would_not_is_named_by_its_key(tmp_path):
    state = good_state()
    assert loadable.refusal(state) is None
    loadable.check_first_save(state)
    state["per_rank"][0]["data"]["rng"] = np.random.get_state()[1]
    with pytest.raises(DdpJobError) as err:
        loadable.check_first_save(state)
    key = "checkpoint state['per_rank'][0]['data']['rng']"
    assert err.value.message.startswith(f"{key}: numpy.ndarray is not loadable with weights_only (it needs numpy.")
    assert "tensor" in err.value.hint and "tolist" in err.value.hint
    # What the check stands for: saved as it is, the state does not load.
    info = store.save(tmp_path, 1, state, keep_last=1)
    with pytest.raises(Exception, match="Weights only load failed"):
        store.load(info)


def test_a_value_that_cannot_be_pickled_or_a_class_of_the_task_is_named_too():
    class Mine:
        pass

    assert loadable.refusal({"scheduler": {"f": lambda: 0}}).startswith("checkpoint state['scheduler']['f']: ")
    found = loadable.refusal({"task": [1, (2, Mine())]})
    assert found.startswith("checkpoint state['task'][1][1]: ") and "Mine is not loadable" in found, found


def test_a_torch_older_than_2_6_loads_no_checkpoint(tmp_path, monkeypatch):
    """CVE-2025-32434: before torch 2.6 a crafted file could run code through weights_only loading. Every checkpoint
    read goes through ``loadable.load``, which refuses such a torch in one line (pip already refuses it: pyproject's
    floor); this torch and newer ones load."""
    for version in ("2.6.0", "2.13.0+cpu", "3.0.0a0+git1234"):
        loadable.require_safe_torch(version)
    with pytest.raises(DdpJobError) as err:
        loadable.require_safe_torch("2.5.1+cu121")
    assert "torch 2.5.1+cu121" in err.value.message and "CVE-2025-32434" in err.value.message
    assert "torch>=2.6" in err.value.hint
    info = store.save(tmp_path, 1, good_state(), keep_last=1)
    assert set(store.load(info)) == {"model", "optimizer", "per_rank"}
    monkeypatch.setattr(torch, "__version__", "2.4.1")  # what an old site install reports
    with pytest.raises(DdpJobError, match=r"torch 2\.4\.1 can be made to run code"):
        store.load(info)
