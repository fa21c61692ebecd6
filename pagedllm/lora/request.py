"""vLLM's ``LoRARequest``: which adapter a request runs with."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter (``lora_path``: a directory holding ``adapter_config.json`` and
    ``adapter_model.safetensors``) known to the engine as ``lora_name`` / ``lora_int_id``.

    ``lora_int_id`` (>= 1) identifies the adapter: requests with the same id share its device
    slot and its prefix-cache blocks, so one id must always name the same weights.
    ``base_model_name`` is what the server lists as the adapter's parent (None: the served model).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an integer >= 1 (0 is the base model)")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r} must name the adapter's directory")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> tuple:
        """What enters a prompt's block hashes: two adapters never share K/V."""
        return ("lora", self.lora_int_id, self.lora_name, self.lora_path)
