"""What the nodes of a multi-node launch must agree on (worker/executor/remote.signature): a node
started with other weights or another KV cache would compute something else without an error."""
from __future__ import annotations

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker.executor.remote import signature


@pytest.mark.parametrize("change", [{"quantization": "int8"}, {"kv_cache_dtype": "fp8"},
                                    {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
                                    {"kv_offload_cpu_gb": 1}, {"block_size": 32}])
def test_settings_that_change_the_weights_or_the_kv_pool_are_in_the_signature(llama_dir, change):
    base = EngineArgs(model=llama_dir, tensor_parallel_size=2, nnodes=2, master_port=29500)
    other = EngineArgs(**{**vars(base), **change})
    assert signature(other.create_engine_config()) != signature(base.create_engine_config())


def test_a_node_local_disk_path_is_not(llama_dir, tmp_path):
    """Each node has its own disk: the tier must be on everywhere, its directory is the node's own."""
    args = dict(model=llama_dir, tensor_parallel_size=2, nnodes=2, master_port=29500)
    one, two = (EngineArgs(**args, kv_offload_cpu_gb=1, kv_offload_dir=str(tmp_path / d)) for d in "ab")
    assert signature(one.create_engine_config()) == signature(two.create_engine_config())
