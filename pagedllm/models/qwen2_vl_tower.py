"""Qwen2-VL's vision tower run on transformers' module (its weights, loaded by their checkpoint
names) by a forward of our own, one image or video per call.

transformers' forward computes the same rows with more passes over memory, and on the CPU the
tower is most of a vision-language request's work (benchmarks/RESULTS.md, multimodal section):

- its linears run on torch's BLAS on the plain weights; here they take ``cpu_ops.linear`` on the
  packed copies ``cpu_ops.pack_model`` keeps (each tower ``nn.Linear`` is given a
  ``packed_weight``; oneDNN's prepacked GEMM, 10-18% faster at a 336x336 image's 576 rows);
- its 2-D rotary tables are built again for every image and applied by five tensor ops per q and
  k; here they are built once per grid (``VisionRotary``) and applied in place by the C rotary
  (``cpu_ops.rotary_neox_``: the vision rotary is the neox rotation over the whole head, with the
  table's first half from the row position and its second from the column);
- its SDPA path splits the attention per frame in a Python loop; the frames of one call have the
  same length, so here they are one batched SDPA call over ``[frames, heads, patches, head_dim]``.

Qwen2.5-VL's tower (windowed attention, RMSNorm, a gated MLP) keeps transformers' forward.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagedllm.layers import cpu_ops


def make_packable(tower: nn.Module) -> None:
    """Gives each ``nn.Linear`` of the tower a ``packed_weight`` slot, so ``cpu_ops.pack_model``
    (at load and whenever the weights change) keeps its packed copy. ``untimed``: the kernel
    table does not time their shapes (an image's rows, hundreds of patches, are mostly past its
    buckets, and the start-up timing doubled on the benchmark model); the fixed thresholds pick
    the kernel."""
    for module in tower.modules():
        if isinstance(module, nn.Linear):
            module.packed_weight = None
            module.untimed = True


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return cpu_ops.linear(x, module.weight, module.bias, getattr(module, "packed_weight", None))


class VisionRotary:
    """The tower's 2-D rotary tables per patch grid ``(h, w)``: ``cos``, ``sin`` ``[h * w,
    head_dim / 2]`` in the tower's patch order (2x2 merge blocks row-major), the first half of
    each row from the patch's row and the second from its column, as transformers'
    ``Qwen2VLVisionRotaryEmbedding`` computes them (its full-width tables repeat this half).
    The last ``capacity`` grids are kept (images of one size share theirs)."""

    def __init__(self, rotary: nn.Module, merge_size: int, capacity: int = 16):
        self.rotary, self.merge_size, self.capacity = rotary, merge_size, capacity
        self.tables: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def __call__(self, h: int, w: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (h, w)
        if key in self.tables:
            self.tables.move_to_end(key)
            return self.tables[key]
        from transformers.vision_utils import get_vision_position_ids
        positions = get_vision_position_ids(torch.tensor([[1, h, w]]), self.merge_size).to(like.device)
        cos, sin = self.rotary(like, positions)  # each [h * w, head_dim]: the half twice
        half = cos.shape[-1] // 2
        table = (cos[:, :half].contiguous(), sin[:, :half].contiguous())
        self.tables[key] = table
        if len(self.tables) > self.capacity:
            self.tables.popitem(last=False)
        return table


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotates x ``[tokens, heads, head_dim]`` (a view with unit inner stride) in place by the
    neox rotation with tables ``[grid, head_dim / 2]`` at ``positions`` ``[tokens]``."""
    if cpu_ops.usable(x, cos, sin):
        cpu_ops.rotary_neox_(x, positions, cos, sin)
        return
    # transformers' apply_rotary_pos_emb_vision: in float32, rounded back to x's dtype
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [tokens, 1, head_dim / 2]
    x1, x2 = x.float().chunk(2, dim=-1)
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def attention(attn: nn.Module, x: torch.Tensor, frames: int, rotary: tuple[torch.Tensor, torch.Tensor],
              positions: torch.Tensor) -> torch.Tensor:
    """One block's attention over ``x`` ``[frames * patches, dim]``: each frame's patches attend
    to each other (transformers' ``cu_seqlens`` for one image or video), in one SDPA call."""
    n, dim = x.shape
    heads = attn.num_heads
    qkv = linear(attn.qkv, x).view(n, 3, heads, dim // heads)
    q, k, v = qkv.unbind(1)  # each [n, heads, head_dim], views into qkv
    rotate_(q, *rotary, positions)
    rotate_(k, *rotary, positions)

    def per_frame(t: torch.Tensor) -> torch.Tensor:  # [n, heads, hd] -> [frames, heads, patches, hd]
        return t.view(frames, n // frames, heads, -1).transpose(1, 2)
    out = nn.functional.scaled_dot_product_attention(per_frame(q), per_frame(k), per_frame(v), scale=attn.scaling)
    return linear(attn.proj, out.transpose(1, 2).reshape(n, dim))  # [frames, heads, patches, hd] -> [n, dim]


def mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = linear(module.fc1, x)
    if module.act.__class__.__name__ == "QuickGELUActivation":
        act = torch.sigmoid(h * 1.702).mul_(h)  # transformers' x * sigmoid(1.702 x), one temporary fewer
    else:
        act = module.act(h)
    return linear(module.fc2, act)


def tower_forward(visual: nn.Module, rotary: VisionRotary, pixels: torch.Tensor,
                  grid_thw: torch.Tensor) -> torch.Tensor:
    """One image's (or video's) merged rows ``[patches / merge ** 2, hidden]`` from its patches
    ``[frames * h * w, patch dim]`` and grid ``[1, 3]`` (transformers' ``pooler_output``)."""
    t, h, w = grid_thw[0].tolist()
    x = visual.patch_embed(pixels)  # [t * h * w, embed_dim]
    tables = rotary(h, w, x)
    positions = torch.arange(h * w, device=x.device).repeat(t)  # each frame's patches, the same rotary
    for block in visual.blocks:
        x = x + attention(block.attn, block.norm1(x), t, tables, positions)
        x = x + mlp(block.mlp, block.norm2(x))
    return merge(visual.merger, x)


def merge(merger: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The patch merger (the projector into the language model): each ``merge ** 2`` consecutive
    patches (one 2x2 block) -> one row ``[hidden]``."""
    x = merger.ln_q(x).view(-1, merger.hidden_size)  # [patches, embed] -> [patches / merge ** 2, merge ** 2 * embed]
    fc1, act, fc2 = merger.mlp
    return linear(fc2, act(linear(fc1, x)))
