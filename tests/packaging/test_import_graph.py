"""The import contract of the four packages: no cycle, no upward import into a package root, no library import of
the demo, and no import of ``jobsim`` (the simulator of tests and benches, outside the wheel) by any of them.

The graph is read from the sources with ``ast``: every ``import`` and ``from ... import`` anywhere in a module (at
the top, in a function, under ``TYPE_CHECKING``) and every ``importlib.import_module("...")`` of a constant name,
each an arrow to the module it names (``from a import b``: ``a.b`` when that is a module, else ``a``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("otel_straggler", "otel_straggler_schema", "collector_processor", "otel_straggler_demo")
LIBRARY = ("otel_straggler", "otel_straggler_schema", "collector_processor")  # what the demo is built on
APPLICATION = "otel_straggler_demo"
SUPPORT = "jobsim"  # tests and benches only: not in the wheel, so no shipped package may import it


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's ``__init__``), for the four packages and ``jobsim`` under
    ``root`` (a C extension by its source, ``_hotpath.c``: it imports none of them)."""
    out: dict[str, tuple[Path, bool]] = {}
    for pkg in (*PACKAGES, SUPPORT):
        for path in sorted([*(root / pkg).rglob("*.py"), *(root / pkg).rglob("*.c")]):
            parts = list(path.relative_to(root).with_suffix("").parts)
            init = parts[-1] == "__init__"
            if init:
                parts.pop()
            out[".".join(parts)] = (path, init)
    return out


def _resolve(importer: str, init: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base[: len(base) - level + (1 if init else 0)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, source: str, init: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that the module ``name`` (its ``source``) imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, init, node.level, node.module)
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in known else base)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for t in targets:
            while t and t not in known:  # ``import a.b.c`` of a name inside a module: that module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules it imports, from module -> (source, is a package ``__init__``)."""
    known = set(sources)
    return {name: imports_of(name, src, init, known) for name, (src, init) in sources.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def violations(g: dict[str, set[str]]) -> list[str]:
    """Arrows against the contract: into a package root from inside that package (a module reaches the package it
    is part of, which imports upward), from a library package into the demo, and from a shipped package into
    ``jobsim``."""
    out = []
    for src, targets in sorted(g.items()):
        for dst in sorted(targets):
            if src.startswith(dst + "."):
                out.append(f"{src} -> {dst} (upward, into its package root)")
            if src.split(".")[0] in LIBRARY and dst.split(".")[0] == APPLICATION:
                out.append(f"{src} -> {dst} (library into the demo)")
            if src.split(".")[0] in PACKAGES and dst.split(".")[0] == SUPPORT:
                out.append(f"{src} -> {dst} (shipped into the simulator)")
    return out


def _tree() -> dict[str, set[str]]:
    return graph({name: (path.read_text() if path.suffix == ".py" else "", init)
                  for name, (path, init) in _modules(ROOT).items()})


def test_the_packages_import_without_cycles() -> None:
    assert cycles(_tree()) == []


def test_imports_point_down() -> None:
    assert violations(_tree()) == []


def test_the_contract_catches_each_kind_of_arrow() -> None:
    """A synthetic tree with one of each: a cycle through a lazy import, one through ``importlib``, one through a
    ``TYPE_CHECKING`` import, an upward import of the root's ``__version__``, a library module importing the
    demo, and the demo importing the simulator."""
    src = {
        "otel_straggler": ("__version__ = '0'", True),
        "otel_straggler.a": ("from otel_straggler import __version__\nfrom . import b", False),
        "otel_straggler.b": ("def f():\n    from otel_straggler.a import x", False),
        "otel_straggler.c": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D", False),
        "otel_straggler.d": ("from otel_straggler.c import C", False),
        "collector_processor": ("", True),
        "collector_processor.registry": ("import importlib\nimportlib.import_module('collector_processor.x')", False),
        "collector_processor.x": ("from collector_processor.registry import F\nimport otel_straggler_demo.run", False),
        "otel_straggler_demo": ("", True),
        "otel_straggler_demo.run": ("import jobsim.stream", False),
        "jobsim": ("", True),
        "jobsim.stream": ("", False),
    }
    g = graph(src)
    assert cycles(g) == [["collector_processor.registry", "collector_processor.x"],
                         ["otel_straggler.a", "otel_straggler.b"], ["otel_straggler.c", "otel_straggler.d"]]
    assert violations(g) == ["collector_processor.x -> otel_straggler_demo.run (library into the demo)",
                             "otel_straggler.a -> otel_straggler (upward, into its package root)",
                             "otel_straggler_demo.run -> jobsim.stream (shipped into the simulator)"]
    assert cycles({k: v for k, v in g.items() if k != "otel_straggler.b"}) == [
        ["collector_processor.registry", "collector_processor.x"], ["otel_straggler.c", "otel_straggler.d"]]
