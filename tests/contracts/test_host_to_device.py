"""One packed host->device transfer per step (contracts/host_to_device.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.contracts.host_to_device import to_device


def test_packed_transfer_round_trips_shapes_dtypes_and_values():
    host = dict(a=np.arange(6, dtype=np.int32).reshape(2, 3), b=np.array([-5, 2**40], dtype=np.int64),
                c=np.zeros((0, 4), dtype=np.int32), d=np.array([7], dtype=np.int64))
    packed = to_device(host, "cpu", pack=True)
    plain = to_device(host, "cpu")
    for name, arr in host.items():
        for t in (packed[name], plain[name]):
            assert t.shape == arr.shape and t.dtype == torch.from_numpy(arr).dtype
            assert t.tolist() == arr.tolist()
    assert plain["a"].data_ptr() == host["a"].ctypes.data  # CPU, unpacked: shares memory, no copy


def test_metadata_from_a_packed_transfer_equals_build():
    q_lens, seq_lens = np.array([1, 5, 3]), np.array([17, 5, 9])
    tables = np.array([[4, 9, 2], [7, 0, 0], [3, 8, 0]], dtype=np.int32)
    host = AttentionMetadata.host_arrays(q_lens, seq_lens, tables, 8)
    packed = AttentionMetadata.from_tensors(to_device(host, "cpu", pack=True), host, 8)
    built = AttentionMetadata.build(q_lens, seq_lens, tables, 8)
    for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        a, b = getattr(packed, field), getattr(built, field)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), field
    # request 0: position 16 -> block index 2; request 2: positions 6, 7 in block 3, 8 in block 8
    assert built.slot_mapping.tolist() == [2 * 8 + 0, 7 * 8 + 0, 7 * 8 + 1, 7 * 8 + 2, 7 * 8 + 3, 7 * 8 + 4,
                                           3 * 8 + 6, 3 * 8 + 7, 8 * 8 + 0]
    assert (packed.max_query_len, packed.max_seq_len) == (5, 17)


def test_one_path_for_every_dtype_with_persistent_buffers_and_refusals():
    """Ints, floats and masks travel the same packed path, into ``out`` buffers of another dtype too."""
    host = dict(ids=np.array([3, 1], dtype=np.int32), temp=np.array([0.5, 2.0], dtype=np.float32),
                mask=np.array([True, False]))
    buf = torch.zeros(2, dtype=torch.int64)
    dev = to_device(host, "cpu", pack=True, out=dict(ids=buf))
    assert list(dev) == ["ids", "temp", "mask"] and dev["ids"] is buf and buf.tolist() == [3, 1]
    assert dev["temp"].dtype == torch.float32 and dev["temp"].tolist() == [0.5, 2.0]
    assert dev["mask"].dtype == torch.bool and dev["mask"].tolist() == [True, False]
    with pytest.raises(TypeError, match="'z' has dtype complex64"):
        to_device(dict(z=np.zeros(2, np.complex64)), "cpu", pack=True)
