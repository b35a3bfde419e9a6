"""Imports point down: no module imports one that (through others) imports it back, and the rooms (the packages
under jaxpaged/, and pallas_kernels/ and server/) form floors, each importing only from below (docs/design.md).

The graph is read from the source (imports under `if TYPE_CHECKING:` are for annotations and are left out), so a
new upward import fails here before it can become an import circle at run time."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxpaged", "pallas_kernels", "server")
TOP = {"jaxpaged.cli", "jaxpaged.__main__"}  # the command line: the one place above the server


@functools.cache
def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports at run time."""
    mods = modules()

    def ours(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text())
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for b in node.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph[m].update(t for t in map(ours, targets) if t and t != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "jaxpaged" or len(parts) == 1 or module in TOP:
        return module if module in TOP else parts[0]
    return ".".join(parts[:2])


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for m, targets in graph.items():
        rooms.setdefault(room(m), set()).update(room(t) for t in targets if room(t) != room(m))
    return rooms


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


def test_the_rooms_import_only_downward():
    rooms = room_graph(import_graph())
    assert cycles(rooms) == [], {r: sorted(t) for r, t in rooms.items()}


@pytest.mark.parametrize("low,forbidden", [
    ("pallas_kernels", {"jaxpaged", "server"}),  # the kernels stand alone, beside their references
    ("jaxpaged.config", {"jaxpaged", "server"}),  # the ground floor: config imports only config (and kernels'
    # availability checks)
    ("jaxpaged.layers", {"jaxpaged.core", "jaxpaged.kv_offload", "jaxpaged.structured", "jaxpaged.spec_decode",
                         "jaxpaged.distributed", "jaxpaged.models", "jaxpaged.runner", "jaxpaged.engine", "server"}),
    # the device layers: arrays in, arrays out, over the kernels
    ("jaxpaged.distributed", {"jaxpaged.engine", "jaxpaged.runner", "jaxpaged.models", "server"}),
    ("jaxpaged.core", {"jaxpaged.engine", "jaxpaged.runner", "jaxpaged.models", "server"}),  # the scheduler
    # knows blocks and requests, not devices
])
def test_floors_below_do_not_reach_up(low, forbidden):
    graph = import_graph()
    bad = sorted((m, t) for m, ts in graph.items() if room(m) == low for t in ts
                 if any(t == f or t.startswith(f + ".") for f in forbidden) and not t.startswith(low)
                 and not (low == "jaxpaged.config" and t.startswith("pallas_kernels")))
    assert bad == []


def test_only_the_command_line_imports_the_server():
    graph = import_graph()
    assert sorted((m, t) for m, ts in graph.items() if m.startswith("jaxpaged") and m not in TOP
                  for t in ts if t.startswith("server")) == []


def test_the_runner_reads_the_schedulers_output_contract_not_the_scheduler():
    graph = import_graph()
    assert sorted((m, t) for m, ts in graph.items() if room(m) == "jaxpaged.runner" for t in ts
                  if t.startswith("jaxpaged.core") and t != "jaxpaged.core.sched.output") == []


def test_only_the_device_layers_reach_the_kernels():
    """(And the benchmarks, which time the kernels themselves.)"""
    graph = import_graph()
    assert sorted((m, t) for m, ts in graph.items() if m.startswith("jaxpaged") for t in ts
                  if t.startswith("pallas_kernels") and room(m) not in ("jaxpaged.layers", "jaxpaged.bench")) == []


def private_imports() -> list[tuple[str, str]]:
    """(module, name) for each `from x import _name` whose x is in another room than the importer."""
    found = []
    for m, f in modules().items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found += [(m, f"{base}.{a.name}") for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and room(base) != room(m)]
    return found


def test_no_private_names_cross_rooms():
    """A name with a leading underscore is its room's own: other rooms import what it makes public."""
    assert private_imports() == []


def test_the_checks_see_a_circle():
    """(The checks above can fail: a made-up circle is found.)"""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert room("jaxpaged.runner.model_runner") == "jaxpaged.runner" and room("server.app") == "server"


MAX_SOURCE_LINES = 500  # one job a file: past this a file is split by job (docs/design.md)


def oversized_sources(root: Path = ROOT, limit: int = MAX_SOURCE_LINES) -> list[str]:
    files = [f for pkg in PACKAGES for pat in ("*.py", "*.cc", "*.h") for f in (root / pkg).rglob(pat)]
    return sorted(f"{f.relative_to(root)}: {n}" for f in files if (n := len(f.read_text().splitlines())) > limit)


def test_no_source_file_over_500_lines():
    """The Python, C++ and header sources of the package, the kernels and the server."""
    assert oversized_sources() == []


def test_the_size_check_sees_a_big_file(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "jaxpaged" / "big.cc").write_text("x\n" * 501)
    (tmp_path / "jaxpaged" / "ok.py").write_text("x\n" * 500)
    assert oversized_sources(tmp_path) == ["jaxpaged/big.cc: 501"]
