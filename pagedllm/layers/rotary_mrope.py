"""M-RoPE (Qwen2-VL, Qwen2.5-VL): the rotary frequencies are split into sections
(``mrope_section``, summing to head_dim / 2) and section ``i`` rotates by position component
``i % 3`` (temporal, height, width) of the token. Positions come as ``[3, num_tokens]``
(multimodal/mrope.py), or as ``[num_tokens]`` when all three components agree, which is plain
RoPE (and takes the plain rotary's fast paths).
"""
from __future__ import annotations

import torch

from pagedllm.layers import cpu_ops
from pagedllm.layers.rotary import RotaryEmbedding, _rotate, _rotate_functional, rope_parameters

MROPE_TYPES = ("default", "mrope")  # "mrope": the early name in Qwen2-VL checkpoints


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor, sections: list[int],
                 ops: str = "native"):
        super().__init__(head_dim, max_position, inv_freq, 1.0, ops)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section={sections} must sum to head_dim / 2 = {head_dim // 2}")
        # frequency j rotates by component [0, 0, 1, 1, 1, 2, 2, 2][j] (sections [2, 3, 3])
        component = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
        self.register_buffer("component", component, persistent=False)
        self._step: tuple[torch.Tensor, ...] | None = None  # (positions, cos, sin, rows) of the last forward

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions ``[num_tokens]`` or ``[3, num_tokens]``; q, k ``[num_tokens, heads, head_dim]``."""
        if positions.ndim == 1:
            return super().forward(positions, q, k)
        if torch.compiler.is_compiling():
            cos, sin = self._select(self.cos, positions), self._select(self.sin, positions)
            cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim // 2]
            return _rotate_functional(q, cos, sin), _rotate_functional(k, cos, sin)
        cos, sin, rows = self._step_tables(positions)
        if q.stride(-1) == 1 and k.stride(-1) == 1 and cpu_ops.usable(q, k, cos):
            # the token's own row of the selected tables: the C rotary in place, one pass per tensor
            cpu_ops.rotary_neox_(q, rows, cos, sin)
            cpu_ops.rotary_neox_(k, rows, cos, sin)
            return q, k
        cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim // 2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _step_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's cos, sin ``[num_tokens, head_dim // 2]`` and ``arange(num_tokens)``: selected
        once per forward, as every layer gets the same positions tensor (held here, so no later
        tensor can be this object)."""
        if self._step is None or self._step[0] is not positions:
            cos, sin = self._select(self.cos, positions), self._select(self.sin, positions)
            rows = torch.arange(positions.shape[1], device=positions.device)
            self._step = (positions, cos.contiguous(), sin.contiguous(), rows)
        return self._step[1:]

    def _select(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, head_dim // 2]``: frequency j at position component ``component[j]``."""
        per_component = table[positions]  # [3, num_tokens, head_dim // 2]
        index = self.component.view(1, 1, -1).expand(1, positions.shape[1], -1)
        return per_component.gather(0, index)[0]


def make_mrotary(hf_config, head_dim: int, max_position: int, ops: str = "native") -> MRotaryEmbedding:
    """The text config's M-RoPE (``rope_parameters`` / ``rope_scaling`` with ``mrope_section``)."""
    params = rope_parameters(hf_config)
    if params["rope_type"] not in MROPE_TYPES or "mrope_section" not in params:
        raise ValueError(f"rope_parameters={params} is not supported for an M-RoPE model: rope_type must be one of "
                         f"{MROPE_TYPES}, with mrope_section")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return MRotaryEmbedding(head_dim, max_position, inv_freq, list(params["mrope_section"]), ops)
