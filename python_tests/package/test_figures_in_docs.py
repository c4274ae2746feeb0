"""Measured figures live in docs/ and benchmarks/results/, not in the code: no comment, docstring or
string of verl_fast/ quotes a timing or names the machine a measurement ran on (a docstring says what
and why; docs/benchmarks.md, "Measurements behind the code's choices", says how much). The benchmark
suite's own data (the seed's claims it checks) is exempt."""

import io
import re
import tokenize
from pathlib import Path

import verl_fast

PKG = Path(verl_fast.__file__).parent
# a timing (12 ms, 0.3 us, 900 tok/s) or a measurement's machine ("on an H200")
FIGURE = re.compile(r"\b\d+(\.\d+)? ?(ms|us|tok/s)\b|\bon an? (H100|H200|A100)\b")
DATA = {"bench/claims.py"}  # the seed's claims, checked by `verl-fast bench`


def figures(source: str):
    """(line, text) of each comment or string token of ``source`` that quotes a figure."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) and FIGURE.search(tok.string):
            yield tok.start[0], FIGURE.search(tok.string).group(0)


def test_no_measured_figure_in_code_text():
    found = [f"{path.relative_to(PKG)}:{line}: {text!r}" for path in sorted(PKG.rglob("*.py"))
             if str(path.relative_to(PKG)) not in DATA for line, text in figures(path.read_text())]
    assert not found, "figures in code text (state them in docs/benchmarks.md instead):\n" + "\n".join(found)


def test_the_check_reads_comments_and_strings_only():
    code = ('x = 12  # took 12 ms\n'
            'def f():\n    """Fast on an H100."""\n    return "0.3 us"\n'
            'ms = 12 * 3\n')
    assert [text for _, text in figures(code)] == ["12 ms", "on an H100", "0.3 us"]
