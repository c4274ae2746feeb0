"""The package's modules import one another without cycles and along the layers README's
Architecture section draws (every import counts: module level, inside functions, and under
TYPE_CHECKING), so that data flows one way: trainer -> algorithms / strategies / rollout -> op
wrappers -> _C / kernels."""

import ast
from pathlib import Path

import pytest

import verl_fast
import verl_fast.kernels

PKG = Path(verl_fast.__file__).parent
KERNELS = Path(verl_fast.kernels.__file__).parent  # kernels/ in the source tree, verl_fast/kernels in a wheel

# The rooms, lowest first: a module may import its own layer and the ones below, never one above.
LAYERS = [
    ("foundation", {"verl_fast", "verl_fast._C", "verl_fast.config", "verl_fast.distributed", "verl_fast.safe_load",
                    "verl_fast.run_files", "verl_fast.output_folder", "verl_fast.metrics_http", "verl_fast.extras",
                    "verl_fast.hub"}),
    ("ops", {"verl_fast.ops", "verl_fast.kernels", "verl_fast.schedule"}),
    ("models, data, rewards, rollout, checkpoints, metrics",
     {"verl_fast.models", "verl_fast.data", "verl_fast.experience", "verl_fast.rewards", "verl_fast.rollout",
      "verl_fast.checkpoint", "verl_fast.direct_write", "verl_fast.metrics", "verl_fast.model_card"}),
    ("algorithms, strategies", {"verl_fast.algos", "verl_fast.strategies"}),
    ("trainer", {"verl_fast.trainer", "verl_fast.async_rl", "verl_fast.catalog"}),
    # verl_fast.benchmarks: the benchmark scripts, which an installed wheel carries for `verl-fast bench`
    ("commands", {"verl_fast.cli", "verl_fast.train_cli", "verl_fast.__main__", "verl_fast.info", "verl_fast.bench",
                  "verl_fast.inference", "verl_fast.benchmarks"}),
]


def _modules():
    out = {}
    for root, package in ((PKG, "verl_fast"), (KERNELS, "verl_fast.kernels")):
        for path in root.rglob("*.py"):
            parts = (package, *path.relative_to(root).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(name, path, modules):
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _cycles(graph):
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return cycles


def _graph():
    modules = _modules()
    # A package's __init__ only re-exports its modules: edges into a package from its own modules
    # (``from verl_fast.rollout import x`` inside verl_fast/rollout/) are not cycles of substance, so a
    # module's import of any package counts as an import of the named module when it is one.
    return {n: {m for m in _imports(n, p, modules) if not (p.name != "__init__.py" and n.startswith(m + "."))}
            for n, p in modules.items()}


def test_no_two_modules_of_one_name():
    """A file's name says which module it is: no two files of verl_fast (and its kernels) share one."""
    seen = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(name)
    twice = {file: names for file, names in seen.items() if len(names) > 1}
    assert not twice, f"files of one name: {twice}"


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _layer(module):
    """The index in LAYERS of the room holding ``module`` (the longest matching room name)."""
    found = [(len(room), i) for i, (_, rooms) in enumerate(LAYERS) for room in rooms
             if module == room or module.startswith(room + ".")]
    assert found, f"{module} is in no layer of LAYERS: add its room there (and to README's Architecture)"
    return max(found)[1]


def test_every_import_goes_down_the_layers():
    """No module imports one of a higher layer (README, Architecture)."""
    graph = _graph()
    upward = sorted(f"{n} ({LAYERS[_layer(n)][0]}) imports {m} ({LAYERS[_layer(m)][0]})"
                    for n, targets in graph.items() for m in targets if _layer(m) > _layer(n))
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("room,forbidden", [
    ("verl_fast.ops", ("verl_fast.trainer", "verl_fast.rollout", "verl_fast.cli", "verl_fast.train_cli")),
    ("verl_fast.kernels", ("verl_fast.trainer", "verl_fast.rollout", "verl_fast.cli", "verl_fast.train_cli")),
    ("verl_fast.rollout", ("verl_fast.trainer",)),
    ("verl_fast.config", ("verl_fast.",)),  # the config imports no room: the rooms register into it
    ("verl_fast.algos", ("verl_fast.strategies", "verl_fast.trainer")),
    ("verl_fast.strategies", ("verl_fast.algos", "verl_fast.trainer")),
    ("verl_fast.metrics", ("verl_fast.trainer",)),
])
def test_named_rules(room, forbidden):
    bad = sorted(f"{n} imports {m}" for n, targets in _graph().items() if n == room or n.startswith(room + ".")
                 for m in targets if any(m == f.rstrip(".") or m.startswith(f if f.endswith(".") else f + ".")
                                         for f in forbidden))
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
