"""kproxy.protocol, kproxy.proxy, kproxy.quota, kproxy.identity, kproxy.envelope, kproxy.replication and
the pure half of kproxy.policy stay sans-I/O (h11's rule): no module in them imports trio, sockets,
TLS, clocks, event loops, OpenTelemetry, YAML or Spark, directly or through another kproxy module,
including the package ``__init__`` files that every import of theirs runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kproxy

FORBIDDEN = frozenset(
    {"trio", "socket", "ssl", "time", "asyncio", "opentelemetry", "yaml", "pyspark", "selectors"}
)
KPROXY_DIR = Path(kproxy.__file__).parent
SANS_IO_PACKAGES = ("kproxy.protocol", "kproxy.proxy", "kproxy.quota", "kproxy.identity", "kproxy.envelope",
                    "kproxy.replication")
# kproxy.policy's loader reads YAML and its store keeps time: only these of its modules are pure.
SANS_IO_MODULES = ("kproxy.policy", "kproxy.policy.model", "kproxy.policy.engine", "kproxy.policy.filter",
                   "kproxy.policy.tenants")


def module_file(name: str, root: Path) -> Path | None:
    """The file of a module under ``root`` (the directory holding the top package), if it exists."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): never run."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            assert isinstance(node, ast.If)
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skipped


def imported_names(path: Path, root: Path, *, runtime_only: bool = False) -> list[tuple[str, int]]:
    """Every module ``path`` imports (with its line), absolute; ``from a import b`` also yields
    ``a.b`` in case ``b`` is a submodule. String arguments of import_module/__import__ count too.
    ``runtime_only`` leaves out the imports under ``if TYPE_CHECKING:``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skipped = type_checking_only(tree) if runtime_only else set()
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            found += [(f"{module}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, node.lineno))
    return found


def parent_packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def violations(start: list[Path], root: Path) -> list[str]:
    """Forbidden imports reachable from ``start`` through modules under ``root``, each with its chain."""
    top = {module_name(p, root).split(".")[0] for p in start}
    chains: dict[Path, str] = {p: module_name(p, root) for p in start}
    todo = list(start)
    bad = []
    while todo:
        path = todo.pop()
        for imported, line in imported_names(path, root):
            first = imported.split(".")[0]
            if first in FORBIDDEN:
                bad.append(f"{chains[path]} imports {first} (line {line})")
            if first not in top:
                continue
            # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
            for dep in [*parent_packages(imported), imported]:
                dep_file = module_file(dep, root)
                if dep_file is not None and dep_file not in chains:
                    chains[dep_file] = f"{chains[path]} -> {dep}"
                    todo.append(dep_file)
    return sorted(set(bad))


def sans_io_files() -> list[Path]:
    files = []
    for package in SANS_IO_PACKAGES:
        directory = KPROXY_DIR.parent.joinpath(*package.split("."))
        # kproxy.proxy is written in parallel with the protocol core and may not exist yet.
        if directory.is_dir():
            files += sorted(directory.rglob("*.py"))
    for name in SANS_IO_MODULES:
        path = module_file(name, KPROXY_DIR.parent)
        assert path is not None, name
        files.append(path)
    return files


def test_the_protocol_package_is_found():
    names = {module_name(p, KPROXY_DIR.parent) for p in sans_io_files()}
    assert {"kproxy.protocol", "kproxy.protocol.messages", "kproxy.protocol.dissect"} <= names


@pytest.mark.parametrize("path", sans_io_files(), ids=lambda p: module_name(p, KPROXY_DIR.parent))
def test_sans_io_module_imports_no_io(path: Path):
    assert violations([path], KPROXY_DIR.parent) == []


# --------------------------------------------------------------------------------------------------
# The checker itself, on a throwaway package, so that a silent checker cannot pass the tests above.


def write(root: Path, name: str, text: str) -> Path:
    path = root.joinpath(*name.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "source",
    [
        "import trio\n",
        "import socket as s\n",
        "from time import monotonic\n",
        "import opentelemetry.trace\n",
        "from asyncio import sleep\n",
        "import os, ssl\n",
        "def f():\n    import yaml\n",
        "import importlib\nimportlib.import_module('pyspark.sql')\n",
        "selectors = __import__('selectors')\n",
    ],
)
def test_checker_catches_direct_imports(tmp_path, source):
    mod = write(tmp_path, "pkg.core.mod", source)
    assert len(violations([mod], tmp_path)) == 1


@pytest.mark.parametrize(
    "source",
    [
        "from pkg.server import run\n",
        "from pkg import server\n",
        "from ..server import run\n",
        "import pkg.server.sub\n",
    ],
)
def test_checker_follows_internal_imports(tmp_path, source):
    write(tmp_path, "pkg.__init__", "")
    write(tmp_path, "pkg.core.__init__", "")
    write(tmp_path, "pkg.server.__init__", "import trio\n")
    write(tmp_path, "pkg.server.sub", "")
    mod = write(tmp_path, "pkg.core.mod", source)
    (found,) = violations([mod], tmp_path)
    assert "pkg.server" in found and "trio" in found


def test_checker_allows_look_alike_names(tmp_path):
    mod = write(tmp_path, "pkg.core.mod", "import timeit\nimport socketserver_like\nfrom datetime import time\n")
    assert violations([mod], tmp_path) == []


# --------------------------------------------------------------------------------------------------
# The command line is the top layer: it imports everything, nothing imports it back (not even lazily,
# inside a function), so the version, the config and the server never depend on argument parsing.

COMMAND_LINE = frozenset({"kproxy.cli", "kproxy.__main__"})


def command_line_imports(root: Path, top: str = "kproxy") -> list[str]:
    """``module imports kproxy.cli (line N)`` for every module under ``root/top`` below the command line."""
    bad = []
    for path in sorted(root.joinpath(top).rglob("*.py")):
        name = module_name(path, root)
        if name in COMMAND_LINE:
            continue
        for imported, line in imported_names(path, root):
            if imported == f"{top}.cli" or imported.startswith(f"{top}.cli."):
                bad.append(f"{name} imports {top}.cli (line {line})")
    return sorted(set(bad))


def test_no_module_below_the_command_line_imports_it():
    assert command_line_imports(KPROXY_DIR.parent) == []


@pytest.mark.parametrize(
    "source",
    ["from kproxy.cli import main\n", "def f():\n    from kproxy import cli\n", "import kproxy.cli\n",
     "from ..cli import main\n"],
)
def test_command_line_check_catches_imports_back(tmp_path, source):
    write(tmp_path, "kproxy.__init__", "")
    write(tmp_path, "kproxy.cli", "from kproxy.server.main import run\n")
    write(tmp_path, "kproxy.server.__init__", "")
    write(tmp_path, "kproxy.server.main", source)
    assert command_line_imports(tmp_path) == [f"kproxy.server.main imports kproxy.cli (line {source.count(chr(10))})"]

def test_config_sits_above_the_protocol_and_needs_only_its_errors():
    # Configuration is loaded by `kproxy check` and every command; generating codecs is not its job.
    # Run in a fresh interpreter: this one has imported everything already.
    code = "import sys, kproxy.config; print(' '.join(sorted(m for m in sys.modules if m.startswith('kproxy'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    assert {m for m in loaded if m.startswith("kproxy.protocol")} == {"kproxy.protocol", "kproxy.protocol.errors"}
    assert not {m for m in loaded if m.startswith(("kproxy.server", "kproxy.proxy", "kproxy.telemetry"))}


def test_config_errors_are_not_a_protocol_matter():
    from kproxy import config
    from kproxy.protocol import errors

    assert not hasattr(errors, "ConfigError")
    assert issubclass(config.ConfigError, errors.KProxyError)


# --------------------------------------------------------------------------------------------------
# No import circles among kproxy's modules: each module can be read, tested and loaded below the ones
# that use it. An import inside a function counts (it runs, only later); one under `if TYPE_CHECKING:`
# does not (it never runs). `from a import b` depends on the package `a` and on `a.b` if that is a module.


def import_graph(root: Path, top: str = "kproxy") -> dict[str, set[str]]:
    """module -> the modules under ``root/top`` it imports (itself left out)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.joinpath(top).rglob("*.py")):
        name = module_name(path, root)
        graph[name] = {imported for imported, _ in imported_names(path, root, runtime_only=True)
                       if imported.split(".")[0] == top and imported != name
                       and module_file(imported, root) is not None}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that import each other, around a circle of any length
    (strongly connected components, Tarjan's algorithm without recursion); each group sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return sorted(groups)


def test_kproxy_has_no_import_cycles():
    graph = import_graph(KPROXY_DIR.parent)
    assert {"kproxy.demo", "kproxy.tour", "kproxy.cli"} <= graph.keys()
    assert "kproxy.demo" in graph["kproxy.cli"]     # the walk sees lazy imports inside functions
    assert import_cycles(graph) == []


@pytest.mark.parametrize(
    ("files", "cycles"),
    [
        # Two modules, one importing the other lazily inside a function (kproxy.demo <-> kproxy.tour was so).
        ({"a": "from kproxy.b import run\n", "b": "def f():\n    from kproxy.a import X\n"},
         [["kproxy.a", "kproxy.b"]]),
        # Three modules around a circle, relative and plain imports.
        ({"a": "import kproxy.b\n", "b": "from . import c\n", "c": "from kproxy.a import X\n"},
         [["kproxy.a", "kproxy.b", "kproxy.c"]]),
        # A package __init__ that imports its submodule, which imports the package back.
        ({"p.__init__": "from kproxy.p.m import X\n", "p.m": "from kproxy.p import Y\n"},
         [["kproxy.p", "kproxy.p.m"]]),
        # Two separate circles.
        ({"a": "import kproxy.b\n", "b": "import kproxy.a\n", "c": "import kproxy.d\n", "d": "import kproxy.c\n"},
         [["kproxy.a", "kproxy.b"], ["kproxy.c", "kproxy.d"]]),
        # No circle: a chain, a shared module below two others, and a type-only import back.
        ({"a": "import kproxy.b\nimport kproxy.c\n", "b": "import kproxy.c\n",
          "c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kproxy.a import X\n"}, []),
        ({"a": "import kproxy.b\n", "b": "import typing\nif typing.TYPE_CHECKING:\n    import kproxy.a\n"}, []),
    ],
)
def test_the_cycle_check_finds_circles_and_only_circles(tmp_path, files, cycles):
    write(tmp_path, "kproxy.__init__", "")
    for name, source in files.items():
        write(tmp_path, f"kproxy.{name}", source)
    assert import_cycles(import_graph(tmp_path)) == cycles
