"""Fixtures shared by the attention tests."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _single_torch_thread():
    """The oracles are loops of tiny torch ops; intra-op threads only add sync overhead there
    (3x slower on a busy 2-core box). Kernel threading is exercised with explicit num_threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
