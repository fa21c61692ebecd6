"""Layers that only point down (docs/design.md, "Layer rules"), and no import cycles.

``LAYERS`` below lists the packages bottom first; every import of every module, also inside
functions and under ``if TYPE_CHECKING:``, must go to its own package or to a lower line. No file
circle, no package loop, and imports inside functions only for the optional dependencies listed
in ``OPTIONAL_IMPORTS``.

The graph has an edge ``a -> b`` when module ``a`` imports ``b`` at module level (imports inside
functions run later and do not count, nor do ``if TYPE_CHECKING:`` blocks, which never run).
``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``. Importing
``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``; those implicit edges are left out, as
every tool that reports cyclic imports does, or every module would sit in a cycle through
``pagedllm/__init__.py``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

PACKAGE_DIR = Path(pagedllm.__file__).parent


def module_names(package_dir: Path, package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` for every .py file under ``package_dir``."""
    names = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join([package, *parts])] = path
    return names


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs, also those inside functions (they run on first call)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
            and n not in _type_checking_imports(tree)]


def _every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, also under ``if TYPE_CHECKING:`` (a type named there is still an arrow)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _type_checking_imports(tree: ast.Module) -> set[ast.AST]:
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If) and _is_type_checking(n.test)]
    return {i for b in blocks for i in ast.walk(b) if isinstance(i, (ast.Import, ast.ImportFrom))}


def _function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements inside a function body (they run on its first call)."""
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [i for f in funcs for i in ast.walk(f) if isinstance(i, (ast.Import, ast.ImportFrom))]


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported (also inside module-level if/try)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not _is_type_checking(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    base = node.module or ""
    if node.level:  # relative: strip one package level per dot beyond the first
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    out = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
    if len(out) < len(node.names) and base in known:
        out.add(base)
    return out


def import_graph(package_dir: Path, package: str, function_level: bool = False,
                 type_checking: bool = False) -> dict[str, set[str]]:
    """``{module: modules it imports at module level}`` (with ``function_level``: anywhere; with
    ``type_checking`` as well: also under ``if TYPE_CHECKING:``), restricted to the package."""
    files = module_names(package_dir, package)
    known = set(files)
    find = _every_import if type_checking else _all_imports if function_level else _top_level_imports
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = set().union(*(_targets(n, name, is_package, known) for n in find(tree))) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_pagedllm_has_no_import_cycle():
    cycle = find_cycle(import_graph(PACKAGE_DIR, "pagedllm"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


WORKER_AREA = ("pagedllm.worker", "pagedllm.distributed", "pagedllm.platform", "pagedllm.kv_cache.sizing")


def test_worker_area_has_no_cycle_even_through_function_level_imports():
    """A cycle hidden behind an import inside a function is still a cycle (the executor once
    imported the model runner, which imported the executor back for ``available_ram``)."""
    graph = import_graph(PACKAGE_DIR, "pagedllm", function_level=True)
    area = {m: {t for t in targets if t.startswith(WORKER_AREA)} for m, targets in graph.items()
            if m.startswith(WORKER_AREA)}
    cycle = find_cycle(area)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_constructed_cycle_is_found(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "from pkg.b import thing\n",
        "sub/__init__.py": "",
        "b.py": "from .sub import c\nthing = 1\n",
        "sub/c.py": "from .. import a\n",  # relative, two levels up
    })
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]


def test_function_level_and_type_checking_imports_do_not_count(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "import pkg.b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                "def f():\n    import pkg.a\n",
    })
    graph = import_graph(pkg, "pkg")
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert find_cycle(graph) is None
    assert find_cycle(import_graph(pkg, "pkg", function_level=True)) == ["pkg.a", "pkg.b", "pkg.a"]


ROUTER = "pagedllm.entrypoints.router"
# the server proper: its app and its request handlers (serving.py, or the per-endpoint modules it
# splits into, named serving*); protocol models and the shared openai_common/http_guards are fine
SERVER = ("pagedllm.entrypoints.openai.api_server", "pagedllm.entrypoints.openai.serving")


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """``{module: the module that first imported it}`` for everything ``start`` imports, directly or not."""
    seen, todo = {start: start}, [start]
    while todo:
        module = todo.pop()
        for target in sorted(graph.get(module, ())):
            if target not in seen:
                seen[target] = module
                todo.append(target)
    return seen


def test_the_router_never_imports_the_server():
    """The router forwards to servers; it shares ``openai_common``/``http_guards`` with the server and
    never imports it, not even inside a function (``serve --data-parallel-size`` hands the server's
    entry point to the router's launcher instead)."""
    graph = import_graph(PACKAGE_DIR, "pagedllm", function_level=True)
    for module in sorted(m for m in graph if m == ROUTER or m.startswith(ROUTER + ".")):
        found = reachable(graph, module)
        bad = sorted(m for m in found if m.startswith(SERVER))
        chain = [bad[0]] if bad else []
        while chain and chain[-1] != module:
            chain.append(found[chain[-1]])
        assert not bad, f"{module} imports the server: {' <- '.join(chain)}"


def test_entrypoints_have_no_cycle_even_through_function_level_imports():
    """The server and the router used to import each other (api_server -> router.data_parallel ->
    api_server.run_server inside a function)."""
    graph = import_graph(PACKAGE_DIR, "pagedllm", function_level=True)
    area = {m: {t for t in targets if t.startswith("pagedllm.entrypoints")} for m, targets in graph.items()
            if m.startswith("pagedllm.entrypoints")}
    cycle = find_cycle(area)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# --- layers that only point down ------------------------------------------------------------------
# Bottom first. A module may import its own package and any package on a lower line, never one on
# its own line or above (docs/design.md, "Layer rules"). Every import counts: at module level,
# inside functions and under ``if TYPE_CHECKING:``. The bottom line is the top-level modules (the
# names vLLM users import) plus ``contracts`` (what crosses between engine, worker and layers).
CORE = ("pagedllm.config", "pagedllm.envs", "pagedllm.utils", "pagedllm.platform", "pagedllm.cpu_threads",
        "pagedllm.sampling_params",
        "pagedllm.pooling_params", "pagedllm.outputs", "pagedllm.version", "pagedllm.contracts",
        # what a request names (vLLM's import path, pagedllm.lora.request): a plain record, like a contract
        "pagedllm.lora.request")
LAYERS: list[tuple[str, ...]] = [
    CORE,
    ("pagedllm.native", "pagedllm.distributed", "pagedllm.metrics"),
    ("pagedllm.attention", "pagedllm.kv_cache", "pagedllm.multimodal", "pagedllm.structured_output"),
    ("pagedllm.layers",),
    ("pagedllm.lora",),  # adapters: checkpoints, slots and the model wrapper over layers' LoRA op
    ("pagedllm.models",),
    ("pagedllm.worker",),
    ("pagedllm.spec_decode",),
    ("pagedllm.engine",),
    ("pagedllm.entrypoints",),
    ("pagedllm", "pagedllm.__main__"),  # the package root re-exports LLM from entrypoints
]

# Imports inside a function are allowed only where what they import is optional (a dependency
# that may be absent, or a backend only one platform runs): ``(importer, imported): why``.
OPTIONAL_IMPORTS = {
    **{(f"pagedllm.layers.{m}", f"pagedllm.layers.triton_ops.{k}"): "Triton is optional (CUDA only)"
       for m, k in [("activation", "activation"), ("fused_moe", "fused_moe"), ("norm", "norm"),
                    ("rotary", "rotary"), ("sampler", "sampling"), ("quantization.grouped", "grouped_gemm"),
                    ("quantization.int8", "int8_gemm")]},
    ("pagedllm.attention.selector", "pagedllm.attention.triton"): "Triton is optional (CUDA only)",
    ("pagedllm.attention.selector", "pagedllm.attention.triton.backend"): "Triton is optional (CUDA only)",
    ("pagedllm.attention.triton", "pagedllm.attention.triton.kernels"): "Triton is optional (CUDA only)",
    ("pagedllm.attention.triton.aot", "pagedllm.attention.triton"): "Triton is optional (CUDA only)",
    **{(a, b): "Triton is optional (CUDA only)" for a, b in [
        ("pagedllm.attention.triton.aot", "pagedllm.attention.triton.latent"),
        ("pagedllm.attention.triton.latent", "pagedllm.attention.triton.backend"),
        ("pagedllm.attention.triton.latent", "pagedllm.attention.triton.mla_kernels"),
        ("pagedllm.layers.lora", "pagedllm.layers.triton_ops.lora"),
        ("pagedllm.layers.quantization.mxfp4", "pagedllm.layers.triton_ops.fused_moe"),
        ("pagedllm.layers.quantization.mxfp4", "pagedllm.layers.triton_ops.mxfp4")]},
    **{(a, b): "Ray is optional (pip install pagedllm[ray])" for a, b in [
        ("pagedllm.engine.arg_utils", "pagedllm.worker.executor.ray"),
        ("pagedllm.worker.executor", "pagedllm.worker.executor.ray"),
        ("pagedllm.entrypoints.router.data_parallel", "pagedllm.entrypoints.router.ray_replicas"),
        ("pagedllm.entrypoints.router.data_parallel", "pagedllm.worker.executor.ray"),
        ("pagedllm.entrypoints.router.ray_replicas", "pagedllm.worker.executor.ray")]},
    ("pagedllm.entrypoints.cli", "pagedllm.entrypoints.dashboard.trace"): "the dashboard's trace is one of the "
                                                                          "optional subcommands cli loads by name",
    ("pagedllm.sampling_params", "pagedllm.contracts.grammar"): "xgrammar is optional until a request "
                                                                 "asks for structured output",
}


def layer_of(module: str) -> int:
    """The line of LAYERS that holds ``module`` (its longest matching package)."""
    best = max((p for line in LAYERS for p in line if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, line in enumerate(LAYERS) if best in line)


def package_of(module: str) -> str:
    """The package ``module`` belongs to; the bottom line counts as one package, so does the top."""
    best = max((p for line in LAYERS for p in line if module == p or module.startswith(p + ".")), key=len)
    return {0: "pagedllm (core)", len(LAYERS) - 1: "pagedllm (root)"}.get(layer_of(module), best)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import of a package on the importer's line or above."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            same_package = package_of(module) == package_of(target)
            if not same_package and layer_of(target) >= layer_of(module):
                bad.append(f"{module} -> {target}")
    return bad


def test_every_module_sits_on_one_layer():
    graph = import_graph(PACKAGE_DIR, "pagedllm")
    for module in graph:
        layer_of(module)  # raises when no line of LAYERS holds it


def test_layers_only_point_down():
    """Every import, also inside functions and under TYPE_CHECKING, goes to the importer's own
    package or to a lower line of LAYERS."""
    bad = upward_imports(import_graph(PACKAGE_DIR, "pagedllm", type_checking=True))
    assert not bad, "imports that point up or sideways:\n  " + "\n  ".join(bad)


def test_no_package_level_loop():
    graph = import_graph(PACKAGE_DIR, "pagedllm", type_checking=True)
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(package_of(module), set()).update(package_of(t) for t in targets)
    packages = {p: targets - {p} for p, targets in packages.items()}
    cycle = find_cycle(packages)
    assert cycle is None, "package loop: " + " -> ".join(cycle)


def test_no_file_level_circle_even_through_function_level_imports():
    cycle = find_cycle(import_graph(PACKAGE_DIR, "pagedllm", function_level=True))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def function_level_imports(package_dir: Path, package: str) -> set[tuple[str, str]]:
    """``(importer, imported)`` for every import of a package module inside a function."""
    files = module_names(package_dir, package)
    known, found = set(files), set()
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _function_imports(tree):
            found |= {(name, t) for t in _targets(node, name, path.name == "__init__.py", known)}
    return found


def test_imports_inside_functions_are_only_for_optional_dependencies():
    found = function_level_imports(PACKAGE_DIR, "pagedllm")
    unlisted = sorted(f"{a} -> {b}" for a, b in found - set(OPTIONAL_IMPORTS))
    assert not unlisted, ("imports inside functions that are not for an optional dependency (move them to "
                          "the top of the module, or list them in OPTIONAL_IMPORTS with the reason):\n  "
                          + "\n  ".join(unlisted))
    stale = sorted(f"{a} -> {b}" for a, b in set(OPTIONAL_IMPORTS) - found)
    assert not stale, "OPTIONAL_IMPORTS entries no longer imported inside a function:\n  " + "\n  ".join(stale)


def test_an_upward_import_is_caught(tmp_path):
    """The check fails on an arrow that points up: a constructed engine module imported by a worker."""
    graph = {"pagedllm.worker.model_runner": {"pagedllm.engine.request", "pagedllm.models.loader"},
             "pagedllm.engine.request": {"pagedllm.sampling_params"},
             "pagedllm.attention.cpu": {"pagedllm.kv_cache.spec"}}
    assert upward_imports(graph) == ["pagedllm.attention.cpu -> pagedllm.kv_cache.spec",
                                     "pagedllm.worker.model_runner -> pagedllm.engine.request"]
    pkg = _write(tmp_path / "pkg", {"__init__.py": "", "a.py": "def f():\n    from pkg import b\n", "b.py": ""})
    assert function_level_imports(pkg, "pkg") == {("pkg.a", "pkg.b")}
