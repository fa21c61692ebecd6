"""The engine's view of the worker's encoder cache: which images' embeddings it holds, which
running requests still need them, and how much encoder work one step may do.

The worker runs the vision tower + projector once per image (``EncoderInput``) and keeps the
embeddings under the image's content hash; every chunk of a prompt that covers part of an image's
placeholder run reads its rows from there, so a chunk boundary may fall inside the run. A
request holds a reference on an image from the step that first needs it until a step after the
one that computed the run's end (that step's forward still reads the rows, so a later chunk of
the same step must not evict them), or until it is preempted or finished; unreferenced entries stay, as a
cache for the next prompt with the same image, until their room is needed (least recently used
first) and the scheduler tells the worker to drop them (``SchedulerOutput.encoder_frees``).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.contracts.scheduler_output import EncoderInput
from pagedllm.metrics.stats import Metric
from pagedllm.multimodal.inputs import MultiModalItem


@dataclass
class EncoderCacheStats:
    # items whose embeddings entered the cache (the vision tower's, or precomputed image_embeds / video_embeds)
    images_encoded: int = 0  # images (and crops of images)
    videos_encoded: int = 0
    video_frames_encoded: int = 0  # the frames of those videos (precomputed video_embeds carry none)
    cache_hits: int = 0  # items a chunk needed that were already encoded (another request, or its own earlier chunk)
    encoder_seconds: float = 0.0  # the vision tower's time, summed over the steps that encoded
    encoder_steps: int = 0  # steps that encoded at least one image


def encoder_cache_bytes(rows: int, hidden_size: int, dtype_bytes: int) -> int:
    """The most the worker's encoder cache holds: ``rows`` embedding rows (the engine sizes the
    cache and a step's encoder budget to max_num_batched_tokens) of the language model's width."""
    return rows * hidden_size * dtype_bytes


class EncoderCacheManager:
    """Bookkeeping for the worker's encoder cache (sizes in embedding rows, i.e. placeholder tokens).

    ``capacity``: rows the cache may hold; ``budget``: rows of images the vision tower may encode
    in one step (vLLM's ``encoder_compute_budget``), so a request with many images cannot starve
    the decodes that share its steps.
    """

    def __init__(self, capacity: int, budget: int):
        self.capacity = capacity
        self.budget = budget
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # hash -> rows, least recently used first
        self.refs: dict[bytes, set[str]] = {}  # hash -> requests that still need it
        self.held: dict[str, set[bytes]] = {}  # request id -> hashes it references
        self.step_left = budget
        self.frees: list[bytes] = []
        self.videos: set[bytes] = set()  # the entries that are videos (the rest: images)
        self.stats = EncoderCacheStats()

    def begin_step(self) -> None:
        self.step_left = self.budget

    def fit(self, items: Sequence[MultiModalItem], start: int, num_new: int) -> int:
        """How many of ``num_new`` tokens from ``start`` can run this step: the chunk stops before
        the first image it needs that is not encoded and does not fit this step's encoder budget
        or the cache's room (0: nothing this step)."""
        left, room = self.step_left, self._room()
        for item in items:
            if not item.overlaps(start, start + num_new) or item.hash in self.entries:
                continue
            if item.length > left or item.length > room:
                return max(0, item.offset - start)
            left -= item.length
            room -= item.length
        return num_new

    def schedule(self, request_id: str, items: Sequence[MultiModalItem], start: int, end: int) -> list[EncoderInput]:
        """Takes references for the images a chunk ``[start, end)`` covers (``fit`` said they fit)
        and returns those the worker must encode this step."""
        to_encode = []
        for item in items:
            if not item.overlaps(start, end):
                continue
            if item.hash in self.entries:
                self.entries.move_to_end(item.hash)
                self.stats.cache_hits += item.hash not in self.held.get(request_id, ())
            else:
                self._evict(item.length)
                self.entries[item.hash] = item.length
                self.step_left -= item.length
                self._count(item)
                to_encode.append(EncoderInput(item.hash, item.data))
            self.refs.setdefault(item.hash, set()).add(request_id)
            self.held.setdefault(request_id, set()).add(item.hash)
        return to_encode

    def release_done(self, request_id: str, items: Sequence[MultiModalItem], num_computed: int) -> None:
        """Drops the request's references on images whose placeholder runs are all computed."""
        for item in items:
            if item.end <= num_computed and item.hash in self.held.get(request_id, ()):
                self._unref(request_id, item.hash)

    def release(self, request_id: str) -> None:
        """Drops every reference of a preempted, swapped-out or finished request."""
        for image in list(self.held.get(request_id, ())):
            self._unref(request_id, image)
        self.held.pop(request_id, None)

    def _count(self, item: MultiModalItem) -> None:
        if item.modality == "video":
            self.stats.videos_encoded += 1
            self.stats.video_frames_encoded += item.frames
            self.videos.add(item.hash)
        else:
            self.stats.images_encoded += 1

    def record_encoder_time(self, seconds: float) -> None:
        """A step's vision-tower time (the worker measures it; steps that encoded nothing are not counted)."""
        self.stats.encoder_seconds += seconds
        self.stats.encoder_steps += 1

    def metrics(self) -> list[Metric]:
        """Images, videos and video frames encoded, encoder-cache hits, the tower's time (seconds and
        steps: their ratio is the time per encoding step), and what the cache holds (images, videos,
        embedding rows)."""
        videos = len(self.videos)
        return [Metric("pagedllm:mm_images_encoded", self.stats.images_encoded, kind="counter"),
                Metric("pagedllm:mm_videos_encoded", self.stats.videos_encoded, kind="counter"),
                Metric("pagedllm:mm_video_frames_encoded", self.stats.video_frames_encoded, kind="counter"),
                Metric("pagedllm:mm_encoder_cache_hits", self.stats.cache_hits, kind="counter"),
                Metric("pagedllm:mm_encoder_seconds", self.stats.encoder_seconds, kind="counter"),
                Metric("pagedllm:mm_encoder_steps", self.stats.encoder_steps, kind="counter"),
                Metric("pagedllm:mm_encoder_cache_images", len(self.entries) - videos),
                Metric("pagedllm:mm_encoder_cache_videos", videos),
                Metric("pagedllm:mm_encoder_cache_usage_perc", sum(self.entries.values()) / self.capacity)]

    def take_frees(self) -> list[bytes]:
        frees, self.frees = self.frees, []
        return frees

    def reset(self) -> None:
        """Forgets every unreferenced entry (the worker is told to drop them)."""
        for image in [h for h in self.entries if not self.refs.get(h)]:
            self._drop(image)

    def _unref(self, request_id: str, image: bytes) -> None:
        self.held[request_id].discard(image)
        users = self.refs.get(image)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self.refs[image]

    def _room(self) -> int:
        """Rows free now or held by unreferenced entries (evictable)."""
        referenced = sum(rows for image, rows in self.entries.items() if self.refs.get(image))
        return self.capacity - referenced

    def _evict(self, rows: int) -> None:
        used = sum(self.entries.values())
        for image in [h for h in self.entries if not self.refs.get(h)]:
            if used + rows <= self.capacity:
                break
            used -= self._drop(image)

    def _drop(self, image: bytes) -> int:
        """Forgets an entry (the worker is told to drop it); returns its rows."""
        self.videos.discard(image)
        self.frees.append(image)
        return self.entries.pop(image)
