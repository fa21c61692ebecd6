"""envs.py is the only reader of environment variables, and it reads them lazily."""
import ast
from pathlib import Path

import pytest

import pagedllm
from pagedllm import envs

PACKAGE = Path(pagedllm.__file__).parent


def _environment_reads(path: Path) -> list[int]:
    """Lines of ``os.environ`` / ``os.getenv`` / ``os.putenv`` uses in one module."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_no_module_but_envs_reads_the_environment():
    offenders = {str(p.relative_to(PACKAGE)): lines for p in PACKAGE.rglob("*.py")
                 if p.name != "envs.py" and (lines := _environment_reads(p))}
    assert offenders == {}


def test_the_scan_finds_a_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx = os.environ.get('A')\ny = os.getenv('B')\n")
    assert sorted(_environment_reads(bad)) == [2, 3]


def test_reads_are_lazy(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FUSED_DECODE", "0")
    assert envs.PAGEDLLM_FUSED_DECODE is False
    monkeypatch.setenv("PAGEDLLM_FUSED_DECODE", "1")
    assert envs.PAGEDLLM_FUSED_DECODE is True
    monkeypatch.delenv("PAGEDLLM_CPU_KVCACHE_SPACE", raising=False)
    assert envs.PAGEDLLM_CPU_KVCACHE_SPACE == 4.0
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0.5")
    assert envs.PAGEDLLM_CPU_KVCACHE_SPACE == 0.5
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", "/x/y")
    assert str(envs.PAGEDLLM_CACHE_DIR) == "/x/y"


def test_bad_number_names_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KVCACHE_SPACE='lots'"):
        _ = envs.PAGEDLLM_CPU_KVCACHE_SPACE


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError):
        _ = envs.PAGEDLLM_NOT_A_VARIABLE


def test_readme_documents_every_variable():
    readme = (PACKAGE.parent / "README.md").read_text()
    assert [name for name in envs.VARIABLES if f"| `{name}` |" not in readme] == []
