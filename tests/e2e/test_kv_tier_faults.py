"""The KV disk tier never takes the engine down: every errno a disk gives (ENOSPC, EACCES, EROFS,
ENOTDIR, EIO) at every filesystem call the tier makes (read, write, rename, unlink, mkdir, stat,
touch, scan, lock) is a miss plus a counted error, the outputs stay those of an engine with no
cache at all, and every KV block is free at the end; a tier that stays broken turns itself off
(one error log) and the engine keeps serving."""
from __future__ import annotations

import errno
import logging
import os
import shutil
from collections import Counter

import pytest
import torch
from test_kv_tiers import PROMPTS, _assert_all_blocks_free, _evict, _llm, _run, _tier

from pagedllm.kv_cache.offload import tier_fs
from pagedllm.kv_cache.offload.disk_tier import DiskTier
from pagedllm.kv_cache.offload.tier_fs import OPS, TierFS

ERRNOS = (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.ENOTDIR, errno.EIO)
METHOD_OPS = {"read_bytes": "read", "write_bytes": "write", "replace": "rename", "unlink": "unlink",
              "mkdir": "mkdir", "exists": "stat", "touch": "touch", "scan": "scan", "list_dir": "scan",
              "locked": "lock"}
DISK_BLOCKS = 24  # the disk budget, in block files: the workload's writes evict (unlink) older ones
BLOCK_FILE = 4200  # bytes of one block file at block_size 8 (4 KiB payload + header)


def _faulty(method: str, op: str):
    real = getattr(TierFS, method)

    def call(self, *args):
        self.calls[op] += 1
        if self.fault is not None and self.fault[0] == op:
            code = self.fault[1]
            raise OSError(code, os.strerror(code), str(args[0]))  # PermissionError, NotADirectoryError, ...
        return real(self, *args)
    return call


class FaultyFS(TierFS):
    """The real filesystem calls, each raising ``OSError(errno)`` while ``fault == (op, errno)``."""

    def __init__(self, fault: tuple[str, int] | None = None):
        self.fault = fault
        self.calls: Counter[str] = Counter()


for _method, _op in METHOD_OPS.items():
    setattr(FaultyFS, _method, _faulty(_method, _op))


@pytest.fixture(scope="module")
def expected(llama_dir):
    llm = _llm(llama_dir, 8, enable_prefix_caching=False)
    return [_run(llm, i) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def seeded_dir(llama_dir, tmp_path_factory):
    """A tier directory holding the document's blocks (written with no faults)."""
    root = tmp_path_factory.mktemp("seeded")
    llm = _llm(llama_dir, 8, disk=root)
    _run(llm, 0)
    _evict(llm)
    llm.llm_engine.shutdown()
    return root


def _engine(llama_dir, root):
    return _llm(llama_dir, 8, disk=root, disk_gb=DISK_BLOCKS * BLOCK_FILE / 2**30)


def _workload(llm, expected) -> None:
    """Loads from disk (read, touch; a corrupt file: unlink), evicts (lock, scan, mkdir, stat, write,
    rename; budget: unlink), clears the tier (lock, scan, unlink), and checks every output."""
    assert _run(llm, 1) == expected[1]
    _evict(llm)
    assert _run(llm, 2) == expected[2]
    assert llm.reset_prefix_cache(reset_disk=True)
    assert _run(llm, 3) == expected[3]
    _evict(llm)
    assert _run(llm, 4) == expected[4]  # a step with tier work: the ranks report their errors
    _assert_all_blocks_free(llm)


def _seed_copy(seeded_dir, dst):
    shutil.copytree(seeded_dir, dst)
    files = sorted(dst.rglob("*.kv"))
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF  # one corrupt entry: reading it deletes it (an unlink on the read path)
    files[0].write_bytes(bytes(data))
    return dst


def test_the_workload_reaches_every_call_site(llama_dir, seeded_dir, expected, tmp_path, monkeypatch):
    fs = FaultyFS()
    monkeypatch.setattr(tier_fs, "LOCAL_FS", fs)
    llm = _engine(llama_dir, _seed_copy(seeded_dir, tmp_path / "t"))
    _workload(llm, expected)
    assert _tier(llm, "disk")["hits"] > 0
    assert set(fs.calls) == set(OPS)
    assert _tier(llm, "disk")["errors"] == dict.fromkeys(OPS, 0)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("code", ERRNOS, ids=[errno.errorcode[c] for c in ERRNOS])
def test_each_errno_at_each_call_site_is_a_counted_miss(llama_dir, seeded_dir, expected, tmp_path, monkeypatch,
                                                        op, code):
    fs = FaultyFS((op, code))
    monkeypatch.setattr(tier_fs, "LOCAL_FS", fs)
    llm = _engine(llama_dir, _seed_copy(seeded_dir, tmp_path / "t"))
    _workload(llm, expected)
    assert fs.calls[op] > 0
    errors = _tier(llm, "disk")["errors"]
    assert errors[op] > 0 and all(n == 0 for o, n in errors.items() if o != op)
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m.value for m in llm.get_metrics()}
    assert metrics[("pagedllm:kv_offload_errors", (("op", op), ("tier", "disk")))] == errors[op]
    llm.llm_engine.shutdown()  # persists what is cached: more failing calls, still no exception


def test_a_tier_that_stays_broken_is_disabled_once_and_the_engine_keeps_serving(llama_dir, expected, tmp_path,
                                                                                 monkeypatch, caplog):
    fs = FaultyFS(("write", errno.EROFS))
    monkeypatch.setattr(tier_fs, "LOCAL_FS", fs)
    llm = _engine(llama_dir, tmp_path)
    with caplog.at_level(logging.WARNING, logger="pagedllm.kv_cache.offload.tier_fs"):
        for round_ in range(2 * tier_fs.MAX_CONSECUTIVE_ERRORS):
            assert _run(llm, round_ % len(PROMPTS)) == expected[round_ % len(PROMPTS)]
            _evict(llm)
            if _tier(llm, "disk")["disabled"]:
                break
    disk = _tier(llm, "disk")
    assert disk["disabled"] == 1 and disk["errors"]["write"] >= tier_fs.MAX_CONSECUTIVE_ERRORS
    assert caplog.text.count("disabled") == 1 and "consecutive write errors" in caplog.text
    assert caplog.text.count("write failed") == 1  # the warnings are rate limited
    calls = sum(fs.calls.values())
    for i in range(len(PROMPTS)):  # off: no filesystem call at all, and the right outputs
        assert _run(llm, i) == expected[i]
        _evict(llm)
    assert sum(fs.calls.values()) == calls
    assert _tier(llm, "disk")["hits"] == 0
    _assert_all_blocks_free(llm)
    llm.llm_engine.shutdown()


def test_fingerprint_directory_replaced_by_a_file(llama_dir, seeded_dir, expected, tmp_path):
    """Not injected: the real ENOTDIR/EEXIST of a file where the tier's directory was."""
    root = _seed_copy(seeded_dir, tmp_path / "t")
    llm = _engine(llama_dir, root)
    for d in [p for p in root.iterdir() if p.is_dir()]:
        shutil.rmtree(d)
        d.write_bytes(b"not a directory")
    _workload(llm, expected)
    errors = _tier(llm, "disk")["errors"]
    assert errors["mkdir"] > 0 and _tier(llm, "disk")["hits"] == 0
    llm.llm_engine.shutdown()
    restarted = _engine(llama_dir, root)  # starts, and serves, with the file still there
    _workload(restarted, expected)
    restarted.llm_engine.shutdown()


@pytest.mark.parametrize("op", OPS)
def test_disk_tier_calls_never_raise(tmp_path, op):
    """Each public DiskTier method under each errno: a miss / nothing written, never an exception."""
    shape = (2, 2, 2, 8, 16)
    block = torch.randn(shape)
    for code in ERRNOS:
        fs = FaultyFS()
        tier = DiskTier(tmp_path / errno.errorcode[code], "ab" * 32, 1 << 20, fs=fs)
        assert tier.write_many([(b"a" * 32, block)]) > 0
        tier.path(b"c" * 32).write_bytes(b"corrupt")
        fs.fault = (op, code)
        tier2 = DiskTier(tier.root, "ab" * 32, 1 << 20, fs=fs)  # its mkdir, at construction
        got = tier.read(b"a" * 32, shape, torch.float32)
        assert got is None or torch.equal(got, block)
        assert tier.read(b"c" * 32, shape, torch.float32) is None
        tier.contains(b"a" * 32)
        tier.write_many([(b"b" * 32, block)])
        tier.usage_bytes()
        tier.clear()
        assert tier.health.errors[op] + tier2.health.errors[op] > 0, (op, code)


def test_a_bad_file_that_cannot_be_deleted_is_skipped_not_read_again(tmp_path):
    """A corrupt entry in a directory the server cannot delete from (read-only, immutable): one
    read, one failed unlink, then a miss with no filesystem call at all."""
    fs = FaultyFS(("unlink", errno.EACCES))
    tier = DiskTier(tmp_path, "ab" * 32, 1 << 20, fs=fs)
    tier.path(b"c" * 32).write_bytes(b"corrupt")
    shape = (2, 2, 2, 8, 16)
    assert tier.contains(b"c" * 32) and tier.read(b"c" * 32, shape, torch.float32) is None
    assert tier.health.errors["unlink"] == 1 and tier.path(b"c" * 32).exists()
    calls = sum(fs.calls.values())
    assert tier.read(b"c" * 32, shape, torch.float32) is None and not tier.contains(b"c" * 32)
    assert sum(fs.calls.values()) == calls
