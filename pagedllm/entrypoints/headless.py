"""``pagedllm serve MODEL --headless --nnodes N --node-rank R ...``: a node that hosts engine ranks
but no engine and no API. Its ranks join node 0's store at ``--master-addr:--master-port``, load
their shard and run node 0's calls until node 0 stops them or goes away (worker/executor/remote.py).
Under torchrun every process whose RANK is not 0 runs this way without the flag."""
from __future__ import annotations

import logging

from pagedllm.config import EngineConfig
from pagedllm.worker.executor.multiproc import Timeouts
from pagedllm.worker.executor.remote import run_node

logger = logging.getLogger(__name__)


def is_headless(config: EngineConfig, headless_flag: bool) -> bool:
    """``--headless``, or a launch that is not node 0 (torchrun's RANK > 0)."""
    return headless_flag or config.parallel.node_rank != 0


def run_headless(config: EngineConfig) -> int:
    """Runs this node's ranks until node 0 stops them; the exit status (1 when a rank failed)."""
    p = config.parallel
    if p.node_rank == 0:
        raise ValueError(f"node_rank=0 with --headless: node 0 hosts the engine and the API; give a headless launch "
                         f"--node-rank in [1, nnodes={p.nnodes})")
    timeouts = Timeouts.from_env()
    logger.info("headless node %d of %d: ranks %d to %d, joining %s:%d", p.node_rank, p.nnodes,
                p.node_rank * p.ranks_per_node, (p.node_rank + 1) * p.ranks_per_node - 1, p.master_addr, p.master_port)
    return run_node(config, timeouts.startup, timeouts.collective)
