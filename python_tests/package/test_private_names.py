"""A private name (``_x``) stays in its room: no module of verl_fast imports one from another room
(``from verl_fast.ops import _validate`` in ``strategies/``) or reads one off a module of another room
it imported (``hf_engine._eos_ids``). A room is a package below verl_fast (its
subpackages included) or a root module; within one room private names are shared freely. The compiled
core ``verl_fast._C`` is loaded by ``ops/native.py`` alone (its one bridge, with the message that says
how to build it)."""

import ast
from pathlib import Path

import import_graph
import verl_fast

PKG = Path(verl_fast.__file__).parent
# private module -> the one module that may import it from outside its room
BRIDGES = {"verl_fast._C": "verl_fast.ops.native"}


def _room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def private_imports(name: str, path: Path):
    """(line, imported name) of each private name that module ``name`` imports: ``from A import _x`` and
    ``import A._x...`` (relative imports resolved); a name of the standard library or another package
    is not verl_fast's and is left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            private = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
            if parts[0] == "verl_fast" and private is not None:
                yield node.lineno, ".".join(parts[: private + 1])


def private_attributes(name: str, path: Path, known):
    """(line, module._x) of each private attribute module ``name`` reads off a verl_fast module it bound
    to a name by an import (``import verl_fast.a.b as m`` / ``from verl_fast.a import b``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            bound.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield node.lineno, f"{bound[node.value.id]}.{node.attr}"


def crossings(modules):
    """``file:line: importer imports name`` for each private name imported from another room."""
    found = []
    for name, path in modules.items():
        for line, target in [*private_imports(name, path), *private_attributes(name, path, modules)]:
            if _room(target) != _room(name) and BRIDGES.get(target) != name:
                found.append(f"{path.parent.name}/{path.name}:{line}: {name} imports {target}")
    return found


def test_no_private_name_is_imported_from_another_room():
    found = crossings(import_graph.modules([(PKG, "verl_fast")]))
    assert not found, "private names imported across rooms (make the name public, or use its room's API):\n" + \
        "\n".join(found)


def test_the_check_sees_each_form_and_allows_the_own_room(tmp_path):
    pkg = tmp_path / "verl_fast"
    (pkg / "ops" / "reshard").mkdir(parents=True)
    (pkg / "strategies").mkdir()
    for folder in (pkg, pkg / "ops", pkg / "ops" / "reshard", pkg / "strategies"):
        (folder / "__init__.py").write_text("")
    (pkg / "ops" / "_validate.py").write_text("def size(x): return x\n")
    (pkg / "ops" / "native.py").write_text("from verl_fast import _C\n")
    (pkg / "ops" / "reshard" / "api.py").write_text("from verl_fast.ops import _validate\nfrom .. import _validate\n")
    (pkg / "strategies" / "a.py").write_text("from verl_fast.ops import _validate as V\n")
    (pkg / "strategies" / "b.py").write_text("import verl_fast.ops._validate\n")
    (pkg / "strategies" / "c.py").write_text("from ..ops._validate import size\nfrom verl_fast import _C\n")
    (pkg / "strategies" / "d.py").write_text("from verl_fast.ops import native\nimport os._wrap_close\n"
                                             "native._cache, native.ext, os._exit\n")
    (pkg / "ops" / "reshard" / "e.py").write_text("import verl_fast.ops.native as n\nn._cache\n")
    found = crossings(import_graph.modules([(pkg, "verl_fast")]))
    assert [f.split(": ", 1)[1] for f in found] == [
        "verl_fast.strategies.a imports verl_fast.ops._validate",
        "verl_fast.strategies.b imports verl_fast.ops._validate",
        "verl_fast.strategies.c imports verl_fast.ops._validate",
        "verl_fast.strategies.c imports verl_fast._C",
        "verl_fast.strategies.d imports verl_fast.ops.native._cache",
    ]
