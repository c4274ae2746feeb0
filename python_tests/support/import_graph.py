"""The import graph of verl_fast read from the source: every import counts --
module level, inside functions, under TYPE_CHECKING, and ``importlib.import_module("...")`` /
``__import__("...")`` calls with a literal name. Used by python_tests/package/test_import_graph.py
and by scripts/import_graph.py, which prints the figures."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable, Dict, List, Set, Tuple

Graph = Dict[str, Set[str]]


def modules(roots: List[Tuple[Path, str]]) -> Dict[str, Path]:
    """Dotted module name -> file, for each (folder, package name) in ``roots``."""
    out = {}
    for root, package in roots:
        for path in sorted(root.rglob("*.py")):
            parts = (package, *path.relative_to(root).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _dynamic_target(node: ast.Call):
    """The literal module name of ``importlib.import_module("x")``, ``import_module("x")`` or
    ``__import__("x")``; None for any other call or a name computed at run time."""
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if called not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imports(name: str, path: Path, known: Dict[str, Path]) -> Set[str]:
    """The modules of ``known`` that the module ``name`` (file ``path``) imports."""
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
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Call) and _dynamic_target(node):
            targets = [_dynamic_target(node)]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph(known: Dict[str, Path]) -> Graph:
    """Module -> the modules it imports. A package's __init__ only re-exports its modules: an import
    of its own package by a module inside it (``from verl_fast.rollout import x`` in verl_fast/rollout/)
    is not counted, so a module's import of a package counts as the named module's where it is one."""
    return {n: {m for m in imports(n, p, known) if not (p.name != "__init__.py" and n.startswith(m + "."))}
            for n, p in known.items()}


def cycles(g: Graph) -> List[List[str]]:
    """The cycles a depth-first walk meets (each as a path that returns to its start)."""
    state, stack, out = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                out.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)
    return out


def circles(g: Graph) -> List[Set[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = set()
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        members.add(m)
                        if m == node:
                            break
                    if len(members) > 1:
                        out.append(members)
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(g[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def upward(g: Graph, floor: Callable[[str], int]) -> List[Tuple[str, str]]:
    """The arrows (importer, imported) that point to a higher floor than the importer's."""
    return sorted((n, m) for n, targets in g.items() for m in targets if floor(m) > floor(n))


def rooms(g: Graph) -> Graph:
    """The graph of rooms: a module's room is its package's first part below the top one
    (``verl_fast.rollout.vllm_engine`` -> ``verl_fast.rollout``; a root module is its own room)."""
    def room(m):
        return ".".join(m.split(".")[:2])
    out: Graph = {room(n): set() for n in g}
    for n, targets in g.items():
        out[room(n)] |= {room(m) for m in targets if room(m) != room(n)}
    return out


def depth(g: Graph) -> int:
    """The levels of ``g`` drawn bottom-up (a module one above the highest it imports), each circle
    counted as one node: the length of the longest chain of imports."""
    circle_of = {n: f"circle {i}" for i, c in enumerate(circles(g)) for n in c}
    dag: Graph = {}
    for n, targets in g.items():
        here = circle_of.get(n, n)
        dag.setdefault(here, set()).update(circle_of.get(m, m) for m in targets if circle_of.get(m, m) != here)
    level: Dict[str, int] = {}

    def visit(k):
        if k not in level:
            level[k] = 1 + max((visit(m) for m in dag[k]), default=0)
        return level[k]

    return max(map(visit, dag), default=0)


def largest(known: Dict[str, Path], kind, top: int) -> List[Tuple[int, str]]:
    """The ``top`` longest definitions of ``kind`` (an ast class or tuple of them): (lines, module:name)."""
    sizes = []
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind):
                sizes.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    return sorted(sizes, key=lambda s: (-s[0], s[1]))[:top]


def figures(known: Dict[str, Path], floor: Callable[[str], int], floors: int, top: int = 5) -> List[str]:
    """The figures of the house as lines of text: modules, floors, arrows, arrows back up, circles,
    the longest files, functions and classes."""
    g = graph(known)
    up = upward(g, floor)
    found = circles(g)
    lines = [f"modules: {len(known)} ({sum(1 for p in known.values() if p.name != '__init__.py')} files "
             f"besides packages' __init__)",
             f"floors declared: {floors}; levels of the drawn graph (longest import chain): {depth(g)}",
             f"arrows (module imports module): {sum(len(t) for t in g.values())}",
             f"rooms (a root module or a package below verl_fast): {len(rooms(g))}, "
             f"on {depth(rooms(g))} levels, {sum(len(t) for t in rooms(g).values())} arrows between them, "
             f"{len(circles(rooms(g)))} circles",
             f"arrows back up (to a higher floor): {len(up)}"]
    lines += [f"  {a} -> {b}" for a, b in up]
    lines.append(f"circles (modules that reach themselves through imports): {len(found)}"
                 + (f", of {', '.join(str(len(c)) for c in found)} modules" if found else ""))
    lines.append("longest files (lines):")
    files = sorted(((len(path.read_text().splitlines()), name) for name, path in known.items()),
                   key=lambda f: (-f[0], f[1]))
    lines += [f"  {n:5d}  {name}" for n, name in files[:top]]
    lines.append("longest functions (lines):")
    lines += [f"  {n:5d}  {where}" for n, where in largest(known, (ast.FunctionDef, ast.AsyncFunctionDef), top)]
    lines.append("longest classes (lines):")
    lines += [f"  {n:5d}  {where}" for n, where in largest(known, ast.ClassDef, top)]
    return lines
