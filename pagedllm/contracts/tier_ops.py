"""The tier moves one scheduler step asks every rank to carry out (ids and hashes, no tensors).

The runner applies ``moves`` in order before the step's forward (an evicted device block is
copied out before a new owner writes into it; a CPU slot is spilled to disk before it is
reused), then the ``loads`` (into device blocks that only the loading request holds), and
reports per load how many leading blocks arrived intact.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# move kinds: (kind, source, destination or block hash)
DEVICE_TO_CPU = "d2c"  # (device block id, CPU slot)
CPU_TO_DISK = "c2disk"  # (CPU slot, block hash)
DEVICE_TO_DISK = "d2disk"  # (device block id, block hash): no CPU tier
CPU_TO_REMOTE = "c2remote"  # (CPU slot, block hash)
DEVICE_TO_REMOTE = "d2remote"  # (device block id, block hash)

TIER_CPU, TIER_DISK, TIER_REMOTE = "cpu", "disk", "remote"
BELOW_CPU = (TIER_DISK, TIER_REMOTE)  # the tiers that hold blocks by hash (one store per rank), in lookup order
TO_TIER = {TIER_DISK: (DEVICE_TO_DISK, CPU_TO_DISK), TIER_REMOTE: (DEVICE_TO_REMOTE, CPU_TO_REMOTE)}
WRITE_TARGET = {DEVICE_TO_DISK: TIER_DISK, CPU_TO_DISK: TIER_DISK,
                DEVICE_TO_REMOTE: TIER_REMOTE, CPU_TO_REMOTE: TIER_REMOTE}


@dataclass(frozen=True)
class LoadItem:
    """One block of a load: from a CPU slot or from the disk file (remote value) of ``block_hash``."""

    device_block: int
    tier: str  # TIER_CPU, TIER_DISK or TIER_REMOTE
    block_hash: bytes
    cpu_slot: int = -1  # TIER_CPU only


@dataclass(frozen=True)
class LoadJob:
    """The tier hits of one request, in block-table order; disk and remote reads are batched per job."""

    request_id: str
    items: tuple[LoadItem, ...]


@dataclass
class TierOps:
    moves: list[tuple[str, int, object]] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.moves or self.loads)


@dataclass(frozen=True)
class LoadReport:
    """What the ranks' tier work came to this step: per request, the leading items that arrived
    intact (every rank agreeing); seconds spent loading per tier (rank 0's); the tiers' failed
    filesystem calls since the last report, ``{tier: {op: count}}`` (rank 0's); the tiers a
    rank disabled, with why (every rank's when the step had loads, else rank 0's); and, per
    networked tier, rank 0's calls since the last report: ``round_trips`` ``[(op, seconds)]`` and
    ``unreachable`` (calls that failed for want of the server)."""

    num_ok: dict[str, int]
    seconds: dict[str, float]
    errors: dict[str, dict[str, int]] = field(default_factory=dict)
    disabled: dict[str, str] = field(default_factory=dict)
    round_trips: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    unreachable: dict[str, int] = field(default_factory=dict)
