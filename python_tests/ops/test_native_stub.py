"""The typed stub verl_fast/_C.pyi says what the compiled module holds: every class, function and
record field it declares exists in _C, and every record's fields are exactly the module's."""

import ast
from pathlib import Path

import verl_fast
from verl_fast import _C

STUB = Path(verl_fast.__file__).with_name("_C.pyi")


def _stub():
    tree = ast.parse(STUB.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    names = [n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)]
    return classes, functions, names


def _fields(cls: ast.ClassDef):
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def test_stub_names_exist():
    classes, functions, names = _stub()
    for name in list(classes) + functions + names:
        assert hasattr(_C, name), f"_C.pyi declares {name}, which _C does not have"


def test_record_fields_match():
    classes, _, _ = _stub()
    for record in ("ScanArgs", "GroupArgs", "ReshardPlanArgs"):
        runtime = {n for n in dir(getattr(_C, record)) if not n.startswith("_")}
        assert _fields(classes[record]) == runtime, record


def test_enums_match():
    classes, _, _ = _stub()
    for enum in ("DType", "AdvantageStatus", "ScanKind", "GroupKind", "ReshardPhase"):
        declared = _fields(classes[enum]) - {"__members__"}
        assert declared == set(getattr(_C, enum).__members__), enum
