"""Tiers below the device block pool: prefix blocks evicted from the pool live on in CPU memory
and on disk, and come back on a prefix hit.

Two halves, talking only through :mod:`~pagedllm.contracts.tier_ops`:

* the scheduler side (:class:`~pagedllm.kv_cache.offload.manager.OffloadManager`) owns the
  bookkeeping: which block hash sits in which CPU slot (an LRU), whether a hash is on disk, and
  the moves each step asks for (device -> CPU on eviction, CPU -> disk when the CPU tier's LRU
  entry leaves it, tier -> fresh device blocks on a hit);
* the worker side (:class:`~pagedllm.kv_cache.offload.worker_store.TierStore`, one per rank)
  holds the bytes: the CPU tier tensor and the rank's disk tier, and carries the moves out.

Device pool -> CPU tier -> disk tier, each with its own LRU and capacity::

    BlockPool.allocate evicts hash h from block b
        -> CPU tier: slot s <- b        (its LRU entry, if full, -> disk first)
        -> disk tier: file of h <- b    (write-through, on the ranks' I/O threads)
    prefix walk: device pool | CPU tier | disk tier, block by block, stopping at the first miss
        -> hits load into freshly allocated device blocks; the request waits one step

Below those, optionally, a remote tier (``remote_tier.py``): the same entries in a Redis/Valkey
server shared by replicas; a block is published there when its last request lets it go (and on
eviction), and the prefix walk ends there: device | CPU | disk | remote. Prefill/decode roles
on that tier (``kv_transfer.py``): a producer publishes a finished request's blocks before its last
output, a consumer only reads.

The preemption swap pool (``swap.py``) stays separate from the CPU tier: swapped blocks belong
to one preempted request and must come back, so they can never be evicted, while tier entries
are a cache that any eviction may drop. Merged, a burst of evictions could fill the space a
preemption needs (forcing recompute), or swapped requests could starve the cache; separate,
each has a budget that holds (``--swap-space`` and ``--kv-offload-cpu-gb``), and the swap pool
costs nothing unless ``preemption_mode="swap"``.
"""
