"""The remote KV tier's URL: schemes checked, refused with the install hint without the redis
client, and the password never logged."""
from __future__ import annotations

import sys

import pytest

from pagedllm.config import CacheConfig, check_remote_url
from pagedllm.kv_cache.offload.remote_tier import redacted


@pytest.mark.parametrize("url", ["http://host:6379", "host:6379", "redis:/x"])
def test_unknown_scheme_is_refused(url):
    with pytest.raises(ValueError, match=r"kv_offload_remote=.*schemes: redis, rediss, valkey"):
        check_remote_url(url)


def test_missing_client_is_refused_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'pagedllm\[redis\]'"):
        CacheConfig(kv_offload_remote="redis://127.0.0.1:6379/0")


def test_ttl_needs_a_remote_tier():
    with pytest.raises(ValueError, match="kv_offload_remote_ttl_s=60 must be > 0 and needs kv_offload_remote"):
        CacheConfig(kv_offload_remote_ttl_s=60)


@pytest.mark.parametrize("url, shown", [
    ("redis://:secret@h:1/0", "redis://:***@h:1/0"),
    ("rediss://user:secret@h:1/0", "rediss://user:***@h:1/0"),
    ("redis://h:1/0", "redis://h:1/0"),
])
def test_password_is_redacted(url, shown):
    assert redacted(url) == shown
