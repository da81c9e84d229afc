"""The package's layering: no import cycles, and each layer loads only what it may."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvfs

PKG = Path(kvfs.__file__).resolve().parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, every: bool = False) -> set[str]:
    """kvfs modules imported at module level (function-level imports are lazy by intent);
    ``every``: also those under ``if TYPE_CHECKING:`` and inside functions."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree) if every else tree.body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # "from pkg import submodule"
    return {m for m in out if m == "kvfs" or m.startswith("kvfs.")}


def _graph(every: bool = False) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {n: {m for m in _imports(p, n, every) if m in files and m != n}
            for n, p in files.items()}


def test_no_import_cycles() -> None:
    _assert_acyclic(_graph())


# packages whose modules import no owner either: no cycle even through imports made only
# for type checking or inside functions (a part gets what it needs through a Protocol or
# arguments, never by importing the module that holds it)
STRICT = ("kvfs.engine", "kvfs.channel", "kvfs.fuse", "kvfs.cli", "kvfs.ops", "kvfs.session",
          "kvfs.warm", "kvfs.torch", "kvfs.shared", "kvfs.vllm")


def test_no_import_cycles_even_lazy_ones() -> None:
    graph = _graph(every=True)
    strict = {n for n in graph if n.startswith(STRICT) or n == "kvfs.mount_runner"}
    _assert_acyclic({n: graph[n] & strict for n in strict})


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_layers_import_only_downwards() -> None:
    """engine < channel < fuse, warm < torch; ops may use engine types; the session's
    files (kvfs.session) sit below every layer that stores sessions and use nothing of
    kvfs; nothing below imports cli."""
    allowed = {
        "kvfs.session": {"kvfs.session"},
        "kvfs.engine": {"kvfs.engine"},
        "kvfs.channel": {"kvfs.channel", "kvfs.engine"},
        "kvfs.warm": {"kvfs.warm", "kvfs.ops", "kvfs.channel", "kvfs.session"},
        "kvfs.ops": {"kvfs.ops", "kvfs.engine"},
        "kvfs.fuse": {"kvfs.fuse", "kvfs.engine", "kvfs.ops", "kvfs.shared", "kvfs.channel",
                      "kvfs.session"},
        "kvfs.torch": {"kvfs.torch", "kvfs.warm", "kvfs.ops", "kvfs.session"},
        "kvfs.shared": {"kvfs.shared", "kvfs.engine", "kvfs.session"},
        "kvfs.vllm": {"kvfs.vllm", "kvfs.torch", "kvfs.warm", "kvfs.ops", "kvfs.mount_runner",
                      "kvfs.session"},
    }
    bad = []
    for mod, deps in _graph().items():
        layer = ".".join(mod.split(".")[:2])
        for d in deps:
            if d == "kvfs":
                continue
            dlayer = ".".join(d.split(".")[:2])
            if layer in allowed and dlayer not in allowed[layer]:
                bad.append(f"{mod} imports {d}")
    assert not bad, "\n".join(sorted(bad))


def _loaded_after(stmt: str) -> set[str]:
    code = f"import sys\n{stmt}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {m.split(".")[0] for m in out.stdout.split()}


def test_engine_loads_neither_fuse_nor_torch() -> None:
    heavy = _loaded_after("import kvfs.engine, kvfs.engine.fsck, kvfs.engine.faults") & {
        "pyfuse3", "trio", "torch", "transformers", "prometheus_client"}
    assert not heavy


def test_warm_tier_loads_no_torch_or_fuse() -> None:
    assert not _loaded_after("import kvfs.warm") & {"pyfuse3", "trio", "torch", "transformers"}


def test_vllm_package_root_is_light() -> None:
    """``kvfs.vllm`` (and its test helpers) load without vLLM: agents and tests import them."""
    assert not _loaded_after("import kvfs.vllm, kvfs.vllm.server_runner") & {"vllm", "torch"}


def test_session_package_loads_no_torch_or_fuse() -> None:
    assert not _loaded_after("import kvfs.session") & {"pyfuse3", "trio", "torch", "redis"}


def test_channel_client_loads_no_fuse() -> None:
    assert not _loaded_after("import kvfs.channel") & {"pyfuse3", "trio", "torch"}


def test_package_root_is_light() -> None:
    assert not _loaded_after("import kvfs") & {"pyfuse3", "torch", "numpy"}


# the warm tier's modules, lowest first: each imports only modules before it (a new module
# must be placed here, which is the point)
WARM_ORDER = ("kvmap_format", "ids", "extent", "space", "rootdir", "shard_index", "summary", "owners",
              "shard", "shardload", "shards", "cold", "checked", "coldfiles", "coldnative", "coldopen",
              "policy",
              "health", "budget", "dirty", "held", "resident", "validate", "reader", "migrate",
              "writeback", "warm_tier")


def test_warm_modules_import_only_downwards() -> None:
    graph = _graph()
    rank = {f"kvfs.warm.{m}": i for i, m in enumerate(WARM_ORDER)}
    mods = {m for m in graph if m.startswith("kvfs.warm.")}
    assert mods == set(rank), f"place these in WARM_ORDER: {sorted(mods ^ set(rank))}"
    bad = [f"{m} imports {d}" for m in mods for d in graph[m]
           if d in rank and rank[d] >= rank[m]]
    assert not bad, "\n".join(sorted(bad))


def _private_defined(tree: ast.AST) -> set[str]:
    """Private names a file defines: functions, classes, attributes it assigns, names,
    arguments and ``__slots__`` entries."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                               for t in n.targets):
            out |= {c.value for c in ast.walk(n.value)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return {x for x in out if x.startswith("_") and not x.startswith("__")}


def test_warm_reaches_no_private_name_of_another_file() -> None:
    """The warm tier is built from parts with named seams: no module touches a private
    attribute or imports a private name that another file defines (mixins sharing
    private state across files are what this keeps out)."""
    bad = []
    for p in sorted((PKG / "warm").glob("*.py")):
        tree = ast.parse(p.read_text(), str(p))
        mine = _private_defined(tree)
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and n.attr.startswith("_")
                    and not n.attr.startswith("__") and n.attr not in mine):
                bad.append(f"{p.name}:{n.lineno} .{n.attr}")
            elif isinstance(n, ast.ImportFrom) and n.module is not None and (
                    n.level or n.module.startswith("kvfs")):
                bad += [f"{p.name}:{n.lineno} imports {a.name}" for a in n.names
                        if a.name.startswith("_")]
    assert not bad, "\n".join(bad)
