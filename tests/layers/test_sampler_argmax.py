"""The sampler's greedy pick (``row_argmax``): the C library's pass on CPU float32 logits picks
what torch's ``max(dim).indices`` picks, ties and NaNs included."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.sampler import row_argmax
from pagedllm.native import bindings

pytestmark = pytest.mark.skipif(not bindings.is_available(), reason="no C compiler")
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("cols", [1, 7, 8, 9, 16, 23, 100, 513])
def test_the_first_maximum_and_the_first_nan_win(cols):
    x = torch.randint(0, 3, (12, cols), generator=torch.Generator().manual_seed(cols)).float()  # many ties
    x[1, cols // 2] = NAN
    x[2, -1] = NAN
    x[3, 0] = NAN
    x[4, -1] = INF
    x[5] = -INF  # a row that allows no token: 0, as torch
    x[6, 0] = -0.0
    x[7] = torch.randn(cols)
    assert torch.equal(row_argmax(x), x.max(dim=-1).indices)


def test_strided_rows_and_the_torch_fallback():
    x = torch.randn(6, 40)[:, 3:33]  # rows of 30 with a stride of 40
    assert torch.equal(row_argmax(x), x.max(dim=-1).indices)
    assert torch.equal(row_argmax(x.double()), x.double().max(dim=-1).indices)  # not float32: torch's
    assert row_argmax(torch.empty(0, 5)).shape == (0,)
