"""``verl.utils.reward_score`` (and what other modules ``serve``) for files written for verl, where verl
is not installed.

A verl recipe's reward file often starts ``from verl.utils.reward_score import gsm8k`` (or ``math``,
``math_dapo``, ``default_compute_score``). While such a file is loaded (``loading_user_code``), an import
hook serves these names with verl's signatures over the scorers here (``verl_scores``: the same
scores, written from verl's behaviour); with verl installed, nothing is served and verl's own modules
load. Any other ``verl.*`` import fails with one line naming the modules served here.

Served:
    verl.utils.reward_score                     default_compute_score(data_source, solution_str, ground_truth, extra_info)
    verl.utils.reward_score.gsm8k               compute_score(solution_str, ground_truth, method, format_score, score),
                                                extract_solution(solution_str, method)
    verl.utils.reward_score.math                compute_score(solution_str, ground_truth), last_boxed_only_string,
                                                remove_boxed, is_equiv
    verl.utils.reward_score.math_dapo           compute_score(solution_str, ground_truth, ...) -> {score, acc, pred}
    verl.utils.reward_score.search_r1_like_qa_em  compute_score(solution_str, ground_truth, format_score, score)
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import types
from typing import Any, Callable, Dict, Iterator, Optional

from verl_fast.rewards import verl_scores

PACKAGE = "verl.utils.reward_score"


def _gsm8k_extract(solution_str: str, method: str = "strict") -> Optional[str]:
    tail = solution_str[-300:]
    if method == "strict":
        found = re.findall(r"#### (-?[0-9.,]+)", tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method != "flexible":
        raise ValueError(f"gsm8k.extract_solution: method must be strict or flexible, got {method!r}")
    numbers = [n for n in re.findall(r"(-?[0-9.,]+)", tail) if n not in ("", ".")]
    return numbers[-1] if numbers else None


def _gsm8k(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
           score: float = 1.0) -> float:
    answer = _gsm8k_extract(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score


def _math(solution_str: str, ground_truth: Any) -> float:
    return verl_scores.math_boxed(solution_str, ground_truth)


def _remove_boxed(s: str) -> Optional[str]:
    return verl_scores.unbox(s)


def _math_dapo(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
               pause_tokens_index: Any = None) -> Dict[str, Any]:
    if strict_box_verify:
        raise ValueError("math_dapo.compute_score: strict_box_verify=True is not served here (verl's own module is)")
    out = verl_scores.math_dapo(solution_str, ground_truth)
    return {"score": out["score"], "acc": bool(out["acc"])}


def _search_r1(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
               score: float = 1.0) -> float:
    found = verl_scores.search_r1_em(solution_str, ground_truth)
    return score * found if found else format_score


def _default(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> Any:
    from verl_fast.rewards import by_source

    by_source.check_source(data_source, "default_compute_score")
    return by_source.scorer_of(data_source)(solution_str, ground_truth)


MODULES: Dict[str, Dict[str, Callable[..., Any]]] = {
    PACKAGE: {"default_compute_score": _default},
    f"{PACKAGE}.gsm8k": {"compute_score": _gsm8k, "extract_solution": _gsm8k_extract},
    f"{PACKAGE}.math": {"compute_score": _math, "last_boxed_only_string": verl_scores.last_boxed,
                        "remove_boxed": _remove_boxed, "is_equiv": verl_scores.math_equivalent},
    f"{PACKAGE}.math_dapo": {"compute_score": _math_dapo},
    f"{PACKAGE}.search_r1_like_qa_em": {"compute_score": _search_r1},
}
PACKAGES = ["verl", "verl.utils", PACKAGE]


def serve(name: str, attributes: Dict[str, Any], package: bool = False) -> None:
    """Serve ``name`` (with ``attributes``) too, where verl is absent (``agents.verl_tools``: verl's tool names)."""
    if package:
        PACKAGES.append(name)
    MODULES[name] = dict(attributes)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the names above; any other ``verl.*`` is an ImportError naming what is served."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name != "verl" and not name.startswith("verl."):
            return None
        if name in PACKAGES or name in MODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=name in PACKAGES)
        raise ImportError(f"No module named {name!r}: verl is not installed, and verl_fast serves only "
                          f"{', '.join(sorted(MODULES))} (pip install verl, or score with a function of your "
                          "own: reward_fn.type=callable)", name=name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, f"verl_fast's stand-in for {spec.name} (verl is not installed)")
        module.__dict__.update(MODULES.get(spec.name, {}))
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ in PACKAGES:
            module.__path__ = []


def verl_installed() -> bool:
    module = sys.modules.get("verl")
    if module is not None:
        return not isinstance(getattr(module, "__loader__", None), _Finder)
    return importlib.util.find_spec("verl") is not None


@contextlib.contextmanager
def loading_user_code() -> Iterator[None]:
    """While a user's reward file loads: ``verl.utils.reward_score`` served when verl is absent (the
    modules stay in ``sys.modules`` for the file's later, lazy imports)."""
    if verl_installed():
        yield
        return
    finder = _Finder()
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
