"""A short storm of benchmarks/soak.py's scenarios against a live server with a small KV pool:
every answer checked, then the server idle with every block free and the same greedy reply.

The scenarios (valid, invalid and rude clients, with the real ``openai`` client) live in the
benchmark, which runs them for minutes; here each runs at least once, in seconds.
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
from pathlib import Path

from live_server import CHAT_TEMPLATE, start_server

from pagedllm.entrypoints.openai.chat_features import ChatOptions

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("pagedllm_bench_soak", _PATH)
soak = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = soak
_spec.loader.exec_module(soak)


def test_short_storm_leaves_the_server_serving(tmp_path, caplog):
    model_dir = soak.tiny_model(tmp_path / "model")
    assert soak.CHAT_TEMPLATE == CHAT_TEMPLATE
    # 20 blocks of 8 tokens: one 128-token sequence fits, a few do not, so n=8 and long replies preempt
    srv = start_server(model_dir, num_gpu_blocks_override=20, max_num_seqs=16,
                       chat_options=ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    try:
        caplog.set_level(logging.WARNING)
        before, book = soak.greedy_reply(srv.url, "tiny"), soak.Book()
        asyncio.run(soak.storm(srv.url, "tiny", 128, book, workers=8, seed=0, requests=2 * len(soak.SCENARIOS),
                               timeout=60))
        assert book.num_failed == 0, dict(book.failures)
        assert {name for name, _ in book.counts} == {s.__name__ for s in soak.SCENARIOS}
        checks = soak.after_storm(srv.url, "tiny", before)
        assert all(ok for ok, _ in checks.values()), checks
        assert srv.wait_idle().num_used_blocks == 0 and srv.engine.num_in_flight == 0
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text
    finally:
        srv.stop()
    srv.engine.engine.scheduler.kv.check_integrity()  # the engine thread has stopped: nothing races it


def test_mixed_abuse_for_a_few_seconds_loses_no_normal_request(tmp_path):
    """benchmarks/soak.py --scenario mixed in miniature: every abuse kind at least once (one abuser per
    kind) beside normal traffic; no normal request lost, /health never down, every abuse answered as
    expected, the server idle afterwards. The latency ratio is the benchmark's to report, not checked."""
    from pagedllm.entrypoints.http_guards import ServerLimits
    model_dir, tier = soak.tiny_model(tmp_path / "model"), tmp_path / "tier"
    srv = start_server(model_dir, api_key=["soak", "abuse"], limits=ServerLimits(request_body_timeout=1.0),
                       num_gpu_blocks_override=24, max_num_seqs=16, kv_offload_dir=str(tier), kv_offload_disk_gb=0.01)
    try:
        result = soak.mixed_abuse(srv.url, "tiny", "soak", "abuse", 6.0, workers=2,
                                  abusers=len(soak.MIXED_ABUSES), tier_dir=str(tier), processes=False)
        assert {kind for kind, _ in result.abuses} == set(soak.MIXED_ABUSES), result.abuses
        assert result.lost == 0 and result.unexpected == 0, result.abuses
        assert result.health["down"] == 0 and result.health["polls"] > 0
        assert srv.wait_idle().num_used_blocks == 0 and srv.engine.num_in_flight == 0
    finally:
        srv.stop()
