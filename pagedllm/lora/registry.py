"""The engine's adapters: each checked against the base model once, before any request runs with it."""
from __future__ import annotations

from pagedllm.config import LoRAConfig
from pagedllm.lora import checkpoint
from pagedllm.lora.request import LoRARequest


class LoRARegistry:
    """Adapters seen by ``lora_int_id``. ``check`` reads an adapter's config and tensor shapes
    (not its data) the first time its id is used and refuses one that cannot run on this base
    model; an id must keep naming the same adapter (name and path), since slots and prefix-cache
    blocks are keyed by it."""

    def __init__(self, config: LoRAConfig, hf_config):
        self.config = config
        self.shapes = checkpoint.module_shapes(hf_config)
        self.num_layers = hf_config.num_hidden_layers
        self.known: dict[int, LoRARequest] = {}

    def check(self, lora: LoRARequest) -> None:
        """ValueError naming the adapter and what is wrong with it."""
        known = self.known.get(lora.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(f"lora_int_id={lora.lora_int_id} already names adapter {known.lora_name!r} at "
                                 f"{known.lora_path!r}; give {lora.lora_name!r} ({lora.lora_path!r}) another id")
            return
        checkpoint.check_shapes(lora.lora_path, self.shapes, self.num_layers, self.config.max_lora_rank)
        self.known[lora.lora_int_id] = lora

    def forget(self, lora_int_id: int) -> None:
        self.known.pop(lora_int_id, None)
