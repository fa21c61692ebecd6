"""The processor-output cache (vLLM's ``mm_processor_cache_gb``): an image's (a video's) HF processor
output, keyed by its content hash and the processor options that shaped it, so a prompt whose items
are all cached skips the pixel processing (resize, rescale, normalise, patching: most of a repeated
image's CPU cost) and only has its text tokenized and its placeholders expanded.

Shared by every tokenizer thread's processor clone (a lock guards it); bounded by the bytes of the
tensors it holds, least recently used first out.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.metrics.stats import Metric
from pagedllm.multimodal.inputs import MultiModalItem

GIB = 1 << 30


def check_cache_gb(value: object) -> float:
    """``mm_processor_cache_gb`` checked: GiB >= 0 (0 disables the processor cache)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"mm_processor_cache_gb={value!r} must be a number of GiB >= 0 (0 disables the cache)")
    return float(value)


@dataclass
class ProcessorCacheStats:
    hits: int = 0  # items a prompt carried that the cache held
    misses: int = 0  # items the HF processor ran for


def item_bytes(item: MultiModalItem) -> int:
    return sum(tensor.nbytes for tensor in item.data.values())


class ProcessorCache:
    """Content key -> the item the processor made for it (its offset meaningless: the prompt's run
    decides it). Thread-safe; holds at most ``capacity_bytes`` of tensors (an item larger than that
    is not kept)."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"mm_processor_cache_gb gives {capacity_bytes} bytes: it must be > 0 (0 disables the "
                             "cache: build none)")
        self.capacity = capacity_bytes
        self.used = 0
        self.entries: OrderedDict[bytes, MultiModalItem] = OrderedDict()
        self.stats = ProcessorCacheStats()
        # modality -> whether tokenizing the text alone and repeating each placeholder token to its
        # item's rows gave the HF processor's ids (checked on every miss; one mismatch turns the
        # cache's fast path off for that modality: e.g. Gemma 3 expands a placeholder into other tokens)
        self.expansion_ok: dict[str, bool] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_gb(cls, gb: float) -> ProcessorCache | None:
        """The cache for ``mm_processor_cache_gb`` (None for 0: disabled)."""
        return cls(int(check_cache_gb(gb) * GIB)) if gb > 0 else None

    def get_all(self, keys: list[bytes]) -> list[MultiModalItem] | None:
        """Every key's item (each marked recently used, each counted a hit), or None (nothing counted)
        if any is missing."""
        with self._lock:
            if not all(key in self.entries for key in keys):
                return None
            for key in keys:
                self.entries.move_to_end(key)
            self.stats.hits += len(keys)
            return [self.entries[key] for key in keys]

    def put(self, key: bytes, item: MultiModalItem) -> None:
        """Keeps ``item`` (one the processor just made: a miss), evicting the least recently used."""
        size = item_bytes(item)
        with self._lock:
            self.stats.misses += 1
            if size > self.capacity or key in self.entries:
                return
            while self.used + size > self.capacity:
                self.used -= item_bytes(self.entries.popitem(last=False)[1])
            self.entries[key] = item
            self.used += size

    def fast_path(self, modalities: set[str]) -> bool:
        """Whether the cached items of these modalities may skip the HF processor (each modality's
        placeholder expansion checked equal to the processor's on a miss, never found different)."""
        with self._lock:
            return all(self.expansion_ok.get(m) for m in modalities)

    def record_expansion(self, modalities: set[str], same: bool) -> None:
        with self._lock:
            for modality in modalities:
                self.expansion_ok[modality] = same and self.expansion_ok.get(modality, True)

    def metrics(self) -> list[Metric]:
        return [Metric("pagedllm:mm_processor_cache_hits", self.stats.hits, kind="counter"),
                Metric("pagedllm:mm_processor_cache_misses", self.stats.misses, kind="counter"),
                Metric("pagedllm:mm_processor_cache_usage_perc", self.used / self.capacity)]
