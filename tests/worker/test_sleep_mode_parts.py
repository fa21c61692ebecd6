"""worker/sleep_mode.py on its own: what level 2 frees and wake gives back, argument checks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.worker import sleep_mode


def _tied_model() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head to its embedding
    model.register_buffer("table", torch.arange(3.0))
    return model


def test_level_2_frees_every_weight_and_wake_restores_the_shapes_and_ties():
    model = _tied_model()
    param = model[0].weight
    state = sleep_mode.put_to_sleep(model, 2, torch.device("cpu"), None)
    assert state.discarded and param.numel() == 0 and model[1].weight is param
    assert sleep_mode.put_to_sleep(model, 2, torch.device("cpu"), state) is state  # asleep already
    sleep_mode.wake(model, state)
    assert model[0].weight is param and model[1].weight is param and param.shape == (10, 4)
    assert torch.equal(model.table, torch.arange(3.0))  # buffers are kept


def test_level_1_on_the_cpu_moves_nothing():
    model = _tied_model()
    before = model[0].weight.data_ptr()
    assert sleep_mode.put_to_sleep(model, 1, torch.device("cpu"), None) is None
    sleep_mode.wake(model, None)
    assert model[0].weight.data_ptr() == before


@pytest.mark.parametrize("level", [0, 3, True, "1"])
def test_bad_levels_are_named(level):
    with pytest.raises(ValueError, match=f"level={level!r}"):
        sleep_mode.check_level(level)


def test_tags():
    assert sleep_mode.check_tags(None) == ("weights", "kv_cache")
    assert sleep_mode.check_tags(["kv_cache", "kv_cache"]) == ("kv_cache",)
    for bad in ("weights", ["weights", "lora"]):
        with pytest.raises(ValueError, match="tags="):
            sleep_mode.check_tags(bad)
