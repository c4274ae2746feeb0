"""The package's modules import one another without cycles and along the floors drawn below
(docs/architecture.md draws them too). Every import counts: module level, inside functions, under
TYPE_CHECKING, and ``importlib.import_module("verl_fast....")`` / ``__import__`` calls with a literal
name, so that data flows one way: trainer -> algorithms / strategies / rollout -> op wrappers ->
_C / kernels. ``python scripts/import_graph.py`` prints the figures."""

from pathlib import Path

import pytest

import import_graph
import verl_fast

PKG = Path(verl_fast.__file__).parent

# The floors, lowest first: a module may import its own floor and the ones below, never one above.
FLOORS = [
    ("foundation", {"verl_fast", "verl_fast._C", "verl_fast.config", "verl_fast.distributed", "verl_fast.files",
                    "verl_fast.metrics.http_server", "verl_fast.extras"}),
    ("ops, records", {"verl_fast.ops", "verl_fast.kernels", "verl_fast.schedule", "verl_fast.records"}),
    ("models, data, rewards, rollout, checkpoints, metrics",
     {"verl_fast.models", "verl_fast.data", "verl_fast.rewards", "verl_fast.rollout",
      "verl_fast.checkpoint", "verl_fast.metrics"}),
    ("algorithms, strategies, agents", {"verl_fast.algos", "verl_fast.strategies", "verl_fast.agents"}),
    ("trainer", {"verl_fast.trainer", "verl_fast.async_rl"}),
    ("commands", {"verl_fast.cli", "verl_fast.__main__", "verl_fast.bench", "verl_fast.inference"}),
]


def _modules():
    return import_graph.modules([(PKG, "verl_fast")])


def _graph():
    return import_graph.graph(_modules())


def floor(module):
    """The index in FLOORS of the floor holding ``module`` (the longest matching name)."""
    found = [(len(room), i) for i, (_, rooms) in enumerate(FLOORS) for room in rooms
             if module == room or module.startswith(room + ".")]
    assert found, f"{module} is on no floor of FLOORS: add it there (and to docs/architecture.md)"
    return max(found)[1]


def test_no_two_modules_of_one_name():
    """A file's name says which module it is: no two files of verl_fast share one."""
    seen = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(name)
    twice = {file: names for file, names in seen.items() if len(names) > 1}
    assert not twice, f"files of one name: {twice}"


def test_no_import_cycles():
    cycles = import_graph.cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_import_goes_down_the_floors():
    """No module imports one of a higher floor."""
    up = import_graph.upward(_graph(), floor)
    assert not up, "imports up the floors:\n" + "\n".join(
        f"{n} ({FLOORS[floor(n)][0]}) imports {m} ({FLOORS[floor(m)][0]})" for n, m in up)


def test_the_graph_reads_dynamic_imports(tmp_path):
    """``importlib.import_module`` / ``__import__`` with a literal name are arrows like ``import``;
    a name computed at run time is not one."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    for name in ("__init__", "low", "high", "other"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "low.py").write_text("import importlib\n\ndef f(name):\n    importlib.import_module('p.high')\n"
                                "    importlib.import_module(name)\n    __import__('p.other')\n")
    g = import_graph.graph(import_graph.modules([(pkg, "p")]))
    assert g["p.low"] == {"p.high", "p.other"}
    assert import_graph.upward(g, {"p": 0, "p.low": 0, "p.other": 0, "p.high": 1}.__getitem__) == [("p.low", "p.high")]
    (pkg / "high.py").write_text("from p import low\n")
    g = import_graph.graph(import_graph.modules([(pkg, "p")]))
    assert import_graph.circles(g) == [{"p.low", "p.high"}] and import_graph.cycles(g)


# helpers of one job that import nothing of verl_fast, so any room may use them (the config reads its
# YAML through yaml_files' limits)
LEAVES = {"verl_fast.config.yaml_files"}


def test_leaves_import_nothing_of_the_package():
    graph = _graph()
    assert all(not graph[leaf] for leaf in LEAVES), {leaf: graph[leaf] for leaf in LEAVES}


@pytest.mark.parametrize("room,forbidden", [
    ("verl_fast.ops", ("verl_fast.trainer", "verl_fast.rollout", "verl_fast.cli")),
    ("verl_fast.kernels", ("verl_fast.trainer", "verl_fast.rollout", "verl_fast.cli")),
    ("verl_fast.rollout", ("verl_fast.trainer",)),
    ("verl_fast.config", ("verl_fast.",)),  # the config imports no other room: the rooms register into it
    ("verl_fast.algos", ("verl_fast.strategies", "verl_fast.trainer", "verl_fast.rollout")),  # a Generate callable
    ("verl_fast.records", ("verl_fast.",)),  # the step's records import nothing above them
    ("verl_fast.strategies", ("verl_fast.algos", "verl_fast.trainer")),
    ("verl_fast.metrics", ("verl_fast.trainer",)),
])
def test_named_rules(room, forbidden):
    bad = sorted(f"{n} imports {m}" for n, targets in _graph().items() if n == room or n.startswith(room + ".")
                 for m in targets - LEAVES if not (m == room or m.startswith(room + "."))
                 and any(m == f.rstrip(".") or m.startswith(f if f.endswith(".") else f + ".") for f in forbidden))
    assert not bad, "\n".join(bad)


def test_import_verl_fast_is_light_and_its_public_names_resolve(tmp_path):
    """``import verl_fast`` loads no torch (the names load on first use), and each public name is
    the object its module defines -- a module only where it is one -- in a fresh interpreter."""
    import subprocess
    import sys

    code = "\n".join([
        "import sys, types, verl_fast",
        "assert 'torch' not in sys.modules",
        "from verl_fast import schedule",  # first: a module-valued name needs nothing imported before it
        "assert isinstance(schedule, types.ModuleType) and hasattr(schedule, 'balance_partitions')",
        "for name in verl_fast.__all__:",
        "    value = getattr(verl_fast, name)",
        "    assert isinstance(value, types.ModuleType) == (name in verl_fast._MODULES), name",
        "assert callable(verl_fast.reshard) and set(verl_fast.__all__) <= set(dir(verl_fast))",
    ])
    # run outside the repository: from its root, `import verl_fast` would find the unbuilt source folder
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_rooms_stand_on_at_most_ten_levels():
    """The graph of rooms (a package below verl_fast, or a root module) drawn bottom-up stays low: at most
    ten levels, none in a circle (``python scripts/import_graph.py`` prints the figure)."""
    rooms = import_graph.rooms(_graph())
    assert not import_graph.circles(rooms), import_graph.circles(rooms)
    assert import_graph.depth(rooms) <= 10, import_graph.depth(rooms)
