"""benchmarks/probes/attention_ab.py: builds alternate on the same batches, and a build whose attention
differs is refused before anything is timed."""
from __future__ import annotations

import shutil

import pytest
from conftest import load_benchmark

from pagedllm.attention.cpu import CpuAttentionBackend
from pagedllm.native.build import CSRC

pytestmark = pytest.mark.skipif(not CpuAttentionBackend.is_available(), reason="no C compiler")

ab = load_benchmark("pagedllm_bench_attention_ab", "probes/attention_ab.py")
TINY = ["--cases", "3x40,1x17", "--heads", "4", "--kv-heads", "2", "--layers", "2", "--rounds", "2",
        "--threads", "1", "--bw-mib", "4"]


def test_builds_alternate_and_report_each_case(capsys):
    # the same folder twice: one cached build, timed as two (a second compile would add ~10 s)
    results = ab.main(["--csrc", f"{CSRC},{CSRC}", *TINY])
    assert list(results) == ["3x40", "1x17"] and all(len(v) == 2 and min(v) > 0 for v in results.values())
    assert len(capsys.readouterr().out.splitlines()) == 2 + 2 * 2


def test_a_build_with_different_output_is_refused(tmp_path):
    wrong = tmp_path / "csrc"
    shutil.copytree(CSRC, wrong)
    src = (wrong / "paged_attention.c").read_text()
    assert src.count("const float inv = 1.0f / (S->l[r] + sink);") == 1
    (wrong / "paged_attention.c").write_text(src.replace("const float inv = 1.0f / (S->l[r] + sink);",
                                                         "const float inv = 1.001f / (S->l[r] + sink);"))
    with pytest.raises(SystemExit, match="output differs"):
        ab.main(["--csrc", f"{CSRC},{wrong}", *TINY])


@pytest.mark.parametrize("bad", [["--cases", "64"], ["--cases", "0x10"]])
def test_bad_cases_are_refused(bad):
    with pytest.raises(SystemExit):
        ab.main(["--csrc", f"{CSRC},{CSRC}", *TINY, *bad])


def test_one_build_is_refused():
    with pytest.raises(SystemExit, match="at least two"):
        ab.main(["--csrc", str(CSRC), *TINY])

