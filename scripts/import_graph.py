"""Prints the figures of verl_fast's import graph: modules, floors, arrows, arrows back up, circles,
the longest files, functions and classes. The floors are those python_tests/package/test_import_graph.py
defines; the graph is read as python_tests/support/import_graph.py reads it.

    python scripts/import_graph.py
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python_tests" / "support"))

import import_graph  # noqa: E402


def main() -> None:
    spec = importlib.util.spec_from_file_location("test_import_graph",
                                                  ROOT / "python_tests" / "package" / "test_import_graph.py")
    test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test)
    print("\n".join(import_graph.figures(test._modules(), test.floor, len(test.FLOORS))))


if __name__ == "__main__":
    main()
