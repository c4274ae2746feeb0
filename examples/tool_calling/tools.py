"""The tool of the tool-calling example: a calculator the model calls with an arithmetic expression."""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers and + - * / // % are allowed, got {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns its value.

    Args:
        expression: An arithmetic expression of numbers, parentheses and + - * / // %, e.g. "3 + 4 * 2".
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    value = _evaluate(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
