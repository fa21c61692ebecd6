"""M-RoPE pieces against transformers: the prompt positions and decode delta against
``get_rope_index``, the rotary against Qwen2-VL's rotary + ``apply_multimodal_rotary_pos_emb``,
and the step's positions (flat when every component agrees)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedllm.layers.rotary_mrope import make_mrotary
from pagedllm.multimodal.inputs import MultiModalItem
from pagedllm.multimodal.mrope import MRopePositions, batch_positions

IMAGE, MERGE = 7, 2


def _prompt(layout: list) -> tuple[list[int], list[MultiModalItem], list[list[int]]]:
    """``layout``: text lengths (int) and image patch grids ((t, h, w) before merging), in order."""
    ids, items, grids = [], [], []
    for part in layout:
        if isinstance(part, int):
            ids += [1] * part
            continue
        t, h, w = part
        length = t * h * w // MERGE**2
        items.append(MultiModalItem(bytes(len(items)), len(ids), length, {}, (t, h // MERGE, w // MERGE)))
        ids += [IMAGE] * length
        grids.append(list(part))
    return ids, items, grids


@pytest.mark.parametrize("layout", [
    [3, (1, 4, 6), 2],
    [(1, 8, 4), 5, (1, 2, 2), 1, (1, 6, 6)],
    [4, (1, 4, 4)],
    [2, (2, 4, 4), 3],  # two frames (a video's grid)
])
def test_positions_equal_get_rope_index(layout):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
    ids, items, grids = _prompt(layout)
    positions = MRopePositions.of(len(ids), items)
    owner = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE)),
                            get_vision_position_ids=lambda *a, **k: Qwen2VLModel.get_vision_position_ids(None, *a, **k))
    types = torch.tensor([[int(t == IMAGE) for t in ids]])  # mm_token_type_ids: 1 on image tokens
    ref, delta = Qwen2VLModel.get_rope_index(owner, torch.tensor([ids]), types, image_grid_thw=torch.tensor(grids))
    assert positions.prompt.tolist() == ref[:, 0].tolist() and positions.delta == int(delta)
    decode = positions.rows(len(ids), len(ids) + 3)
    assert decode.tolist() == [[positions.prompt.max() + 1 + i for i in range(3)]] * 3
    assert positions.rows(1, len(ids) + 2).shape == (3, len(ids) + 1)


def test_text_only_prompts_have_plain_positions():
    assert MRopePositions.of(5, ()) is None
    assert batch_positions([None, None], [2, 1], np.array([0, 1, 7])).tolist() == [0, 1, 7]


def test_step_positions_flat_unless_an_image_row_differs():
    ids, items, _ = _prompt([2, (1, 4, 4)])  # 2 text + 4 image tokens
    positions = MRopePositions.of(len(ids), items)
    decode = batch_positions([positions.rows(6, 7), None], [1, 1], np.array([6, 9]))
    assert decode.tolist() == [6 + positions.delta, 9]  # flat: the plain rotary, C decoder, graphs apply
    prefill = batch_positions([positions.rows(0, 6), None], [6, 1], np.zeros(7, dtype=np.int64))
    assert prefill.shape == (3, 7) and prefill[:, :6].tolist() == positions.prompt.tolist()


def test_mrotary_equals_transformers():
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb
    cfg = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    rotary = make_mrotary(cfg, 16, 64)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    # a second positions tensor of the same shape gets its own tables (they are kept for one forward's layers)
    for positions in (torch.randint(0, 60, (3, 5)), torch.randint(0, 60, (3, 5))):
        ours_q, ours_k = rotary(positions, q.clone(), k.clone())
        cos, sin = Qwen2VLRotaryEmbedding(cfg)(q, positions[:, None])  # [1, 5, 16] each, sections recomposed
        ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1))  # ref [1, heads, 5, 16]
        torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1))
    flat = positions[0]
    flat_q, _ = rotary(flat, q.clone(), k.clone())  # [num_tokens] positions: plain RoPE
    same_q, _ = rotary(flat.expand(3, -1), q.clone(), k.clone())
    torch.testing.assert_close(flat_q, same_q)


def test_bad_mrope_config_is_refused():
    cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 2]})
    with pytest.raises(ValueError, match="must sum to head_dim / 2 = 8"):
        make_mrotary(cfg, 16, 8)
    with pytest.raises(ValueError, match="rope_type must be one of"):
        make_mrotary(SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), 16, 8)
