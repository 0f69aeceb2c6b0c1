"""The package's layers: no import circles and no import up the layers (read with ``ast``, nothing imported), and the
old names of renamed callbacks still import, with a ``DeprecationWarning``.

Every ``import`` / ``from ... import`` of the package's own modules counts: at the top of a file, inside a function
and under ``TYPE_CHECKING`` alike (a circle that only a type annotation closes is still a circle for the reader and
for the next refactoring). An import of a package (``from lightning_dist.strategy import features_of``) is an import
of that package's ``__init__``, which sits in the package's layer.
"""

from __future__ import annotations

import ast
import functools
import importlib
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dist"

# The layers, lowest first: a module may import from its own layer and the ones below, never from one above. Each
# entry is a top-level module or subpackage of lightning_dist ("__init__" is the package root, lightning_dist/__init__).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # torch.distributed's collectives, the launch environment, and leaves that import nothing of the package (conf:
    # the Hydra configs' package; upstream: every private name of Lightning and torch the package reaches)
    ("base", ("_deprecation", "comm", "conf", "examples", "identities", "launch", "loss_scaler", "perf", "profiling",
              "simcluster", "upstream")),
    # gradient compressors over a Transport (comm's collectives)
    ("compression", ("compression",)),
    # the mechanisms callbacks and the strategy drive: per-rank batches, memory, checkpoints and faults, syncing
    # every H steps
    ("mechanisms", ("fault", "hetero", "memory", "sync")),
    # elastic runs: the ledger and what state survives a change of world, over fault's checkpoints
    ("elastic", ("elastic",)),
    # Lightning's side: RingDDPStrategy, its hook, and the seam features use (RingFeatures)
    ("strategy", ("strategy",)),
    # features on the seam: the callbacks, the test helpers, the package's front door
    ("features", ("__init__", "callbacks", "testing")),
    # the Hydra command: its schema and checks, and the command itself
    ("command", ("config", "train")),
    # tools built on the command and the features: lightning-dist-advise (a product command: it reads no benchmark)
    ("tools", ("advise",)),
    # what measures the product and nothing imports: the benchmarks, and the notebooks' experiments (which borrow the
    # benchmarks' table printer); a table the product quotes is product data the benchmark writes
    ("benchmarks", ("benchmarks", "experiments")),
)
# The top layer: no module below it imports anything of it
MEASUREMENT = LAYERS[-1][1]


def layer_of(module: str) -> int:
    """The layer index of ``module`` (``lightning_dist.x.y``); KeyError for a module no layer lists."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, (_, members) in enumerate(LAYERS):
        if top in members:
            return index
    raise KeyError(module)


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


@functools.cache  # read once for the four tests that walk it (none changes it)
def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the package's own modules, every import statement counted."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:
                    parts = base.split(".")
                    target = ".".join(parts[: len(parts) - node.level + 1] + ([target] if target else []))
                # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself
                names = [f"{target}.{alias.name}" for alias in node.names]
            for name in names:
                if name.split(".")[0] != PACKAGE.name:
                    continue
                found = resolve(name)
                if found is not None and found != module:
                    edges.setdefault(found, node.lineno)
        graph[module] = edges
    return graph


def _where(graph: dict[str, dict[str, int]], module: str, imported: str) -> str:
    path = _modules()[module].relative_to(PACKAGE.parent)
    return f"{path}:{graph[module][imported]} imports {imported}"


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for child in edges:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    unlisted = []
    for module in _modules():
        try:
            layer_of(module)
        except KeyError:
            unlisted.append(module)
    assert not unlisted, f"add these modules to a layer of LAYERS in tests/test_layers.py: {unlisted}"


def test_no_import_circles():
    graph = import_graph()
    circles = _circles(graph)
    details = [" <-> ".join(c) + ": " + "; ".join(_where(graph, a, b) for a in c for b in graph[a] if b in c)
               for c in circles]
    assert not circles, "import circles:\n  " + "\n  ".join(details)


def _upward(graph: dict[str, dict[str, int]]) -> list[tuple[str, str]]:
    """Every (module, imported module) edge of ``graph`` that runs up the layers."""
    return [(module, imported) for module, edges in graph.items() for imported in edges
            if layer_of(imported) > layer_of(module)]


def test_no_import_runs_up_the_layers():
    graph = import_graph()
    upward = [f"{_where(graph, module, imported)} ({LAYERS[layer_of(module)][0]} -> "
              f"{LAYERS[layer_of(imported)][0]}, a higher layer)" for module, imported in _upward(graph)]
    assert not upward, "imports up the layers:\n  " + "\n  ".join(upward)


def test_no_product_module_imports_the_benchmarks():
    # the rule the layers above enforce, said once by name: the product (advise included) reads no benchmark
    def measures(module: str) -> bool:
        return (module.split(".") + ["__init__"])[1] in MEASUREMENT

    graph = import_graph()
    found = [_where(graph, module, imported) for module, edges in graph.items() for imported in edges
             if measures(imported) and not measures(module)]
    assert not found, "product modules import benchmarks or experiments:\n  " + "\n  ".join(found)


def test_the_checks_see_what_they_must():
    # the same walk finds a circle and an upward import when there is one (the checks above can fail)
    graph = {"lightning_dist.a": {"lightning_dist.b": 1}, "lightning_dist.b": {"lightning_dist.a": 2},
             "lightning_dist.c": {}}
    assert _circles(graph) == [["lightning_dist.a", "lightning_dist.b"]]
    real = import_graph()
    assert "lightning_dist.strategy.features" in real["lightning_dist.callbacks.rank_values"]  # a top-level import
    assert layer_of("lightning_dist.comm.ring") < layer_of("lightning_dist.strategy.hook") < layer_of(
        "lightning_dist.callbacks.nan_recovery") < layer_of("lightning_dist.advise") < layer_of(
        "lightning_dist.benchmarks.cluster")
    # advise reading its accuracy table from the compression benchmark (as it did) is an import up the layers
    old = {"lightning_dist.advise": {"lightning_dist.benchmarks.compression": 78}}
    assert _upward(old) == [("lightning_dist.advise", "lightning_dist.benchmarks.compression")]
    assert "lightning_dist.compression.accuracy" in real["lightning_dist.advise"]


# -- renamed callbacks: the old names import for one release, with a warning ----------------------------------------
@pytest.mark.parametrize("module,old,new", [
    ("lightning_dist", "DistMetricsCallback", "DistMetrics"),
    ("lightning_dist.callbacks", "DistMetricsCallback", "DistMetrics"),
    ("lightning_dist.strategy.dist_metrics", "DistMetricsCallback", "DistMetrics"),
    ("lightning_dist.advise", "AdviseCallback", "Advisor"),
    ("lightning_dist.advise", "RecordingRingDDPStrategy", "RingDDPStrategy"),
])
def test_old_names_still_import_with_a_deprecation_warning(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{module}.{old} is deprecated.*{new}"):
        value = getattr(mod, old)
    assert value is getattr(mod, new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name warns about nothing
        getattr(mod, new)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mod.Nope


def test_every_callback_is_exported_from_the_package_root():
    import lightning_dist
    from lightning_dist import callbacks

    for name in ("DistMetrics", "ElasticTraining", "FaultTolerance", "MemoryMonitor", "NaNRecovery"):
        assert getattr(lightning_dist, name) is getattr(callbacks, name) and name in lightning_dist.__all__


def _lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def test_the_benchmarks_are_at_most_a_quarter_of_the_package():
    """What measures the product stays smaller than the product: ``benchmarks/`` at most 25% of the package's Python
    lines (the house's rule since issue 40; a benchmark shares what it repeats, through benchmarks/_common.py)."""
    package = _lines(PACKAGE.rglob("*.py"))
    benchmarks = _lines((PACKAGE / "benchmarks").rglob("*.py"))
    assert benchmarks <= package / 4, f"benchmarks/ is {benchmarks} of {package} lines ({benchmarks / package:.1%})"
