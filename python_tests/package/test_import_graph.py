"""The package's modules import one another without cycles (every import counts: module level,
inside functions, and under TYPE_CHECKING), so that data flows one way: trainer -> algorithms /
rollout -> op wrappers -> _C / kernels."""

import ast
from pathlib import Path

import verl_fast

PKG = Path(verl_fast.__file__).parent


def _modules():
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
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


def test_no_import_cycles():
    modules = _modules()
    # A package's __init__ only re-exports its modules: edges into a package from its own modules
    # (``from verl_fast.rollout import x`` inside verl_fast/rollout/) are not cycles of substance, so a
    # module's import of any package counts as an import of the named module when it is one.
    graph = {n: {m for m in _imports(n, p, modules) if not (p.name != "__init__.py" and n.startswith(m + "."))}
             for n, p in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


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
