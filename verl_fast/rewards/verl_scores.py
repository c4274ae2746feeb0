"""verl's rule-based scorers, by behaviour (verl/utils/reward_score/*.py, read, not copied): the
score a verl run gives each response, so that a run moved here keeps its reward.

- ``gsm8k_strict``: the answer must follow GSM8K's ``#### `` marker within the response's last 300
  characters; commas and ``$`` dropped; equal as text to the ground truth: 1.0, else 0.0
  ("The answer is 14" scores 0: verl's strict format check).
- ``math_boxed`` (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500): the
  last ``\\boxed{...}`` (or ``\\boxed x``, ``\\fbox{...}``), both sides normalised as the
  Hendrycks MATH harness does (fractions, units, spaces, ``\\left``, ...): 1.0 when equal, else 0.0.
- ``math_dapo`` (math_dapo, math, math_dapo_reasoning, aime*): the last ``Answer: ...`` line of the
  response's last 300 characters, normalised as Minerva does; ``{"score": 1.0 or -1.0, "acc": 0/1}``.
- ``geo3k`` (hiyouga/geometry3k): 0.9 x the last ``\\boxed{...}`` equal to the ground truth (as
  ``math_boxed`` compares them; verl grades with mathruler's sympy check, whose equivalences beyond this
  normalisation are not counted here) + 0.1 x the format ``<think>...</think>...\\boxed{...}...``.
- ``search_r1_em`` (searchR1_*): the last ``<answer>...</answer>`` exactly matching one of
  ``ground_truth["target"]`` after SQuAD normalisation: 1.0 (a quarter when the response holds more than
  10 opening or closing tags), else 0.0.
"""

from __future__ import annotations

import re
import string
from typing import Any, Dict, Optional

_TAIL = 300  # verl scores the end of a response only (a long response's regex cost; answers come last)

# ----------------------------------------------------------------------------- GSM8K


def gsm8k_strict(solution: str, ground_truth: Any) -> float:
    found = re.findall(r"#### (-?[0-9.,]+)", solution[-_TAIL:])
    if not found:
        return 0.0
    answer = found[-1].replace(",", "").replace("$", "")
    return 1.0 if answer == str(ground_truth) else 0.0


# ----------------------------------------------------------------------------- MATH (Hendrycks)


def last_boxed(text: str) -> Optional[str]:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` group with balanced braces (or ``\\boxed x`` up to a
    ``$``), as written; None when there is none or its braces never close."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start: i + 1]
    return None


def unbox(boxed: str) -> Optional[str]:
    """The content of ``\\boxed{x}`` / ``\\boxed x``; None for any other shape (verl's assertion
    failure, which it scores 0)."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed "):]
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    return None


def _braced_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}`` (the shorthand forms)."""
    head, *parts = s.split("\\frac")
    out = [head]
    for part in parts:
        if part.startswith("{"):
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out.append("\\frac{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest))
    return "".join(out)


def _slash_as_frac(s: str) -> str:
    pieces = s.split("/")
    if len(pieces) != 2:
        return s
    try:
        a, b = int(pieces[0]), int(pieces[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _braced_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``; a ``\\sqrt`` with nothing after it cannot be read (IndexError)."""
    head, *parts = s.split("\\sqrt")
    out = [head]
    for p in parts:
        out.append("\\sqrt" + (p if p.startswith("{") else "{" + p[0] + "}" + p[1:]))
    return "".join(out)


def math_normalise(s: str) -> str:
    """The Hendrycks MATH answer normalisation (what verl's math_reward compares)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # units on the right
        pieces = s.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("more than one unit")
        s = pieces[0]
    s = s.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> "3"
        s = sides[1]
    s = _braced_sqrt(s).replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_as_frac(s)


def math_equivalent(a: str, b: str) -> bool:
    try:
        return math_normalise(a) == math_normalise(b)
    except (ValueError, IndexError):  # a shape the normalisation cannot read: compared as written
        return a == b


def math_boxed(solution: str, ground_truth: Any) -> float:
    boxed = last_boxed(solution)
    answer = unbox(boxed) if boxed is not None else None
    return 1.0 if answer is not None and math_equivalent(answer, str(ground_truth)) else 0.0


_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
GEO3K_FORMAT_SCORE = 0.1  # the format's share of the score, as verl weighs it


def geo3k(solution: str, ground_truth: Any) -> float:
    formatted = 1.0 if _GEO3K_FORMAT.fullmatch(solution) else 0.0
    return (1.0 - GEO3K_FORMAT_SCORE) * math_boxed(solution, ground_truth) + GEO3K_FORMAT_SCORE * formatted


# ----------------------------------------------------------------------------- DAPO (Minerva)

_MINERVA_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                          ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
                    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
                    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
                    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
                    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots")


def minerva_normalise(answer: str) -> str:
    answer = answer.split("=")[-1]
    for old, new in _MINERVA_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for gone in _MINERVA_REMOVED:
        answer = answer.replace(gone, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer).replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def math_dapo(solution: str, ground_truth: Any) -> Dict[str, float]:
    found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", solution[-_TAIL:])
    pred = minerva_normalise(found[-1] if found else "[INVALID]")
    correct = pred == minerva_normalise(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": float(correct)}


# ----------------------------------------------------------------------------- Search-R1 exact match


def squad_normalise(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def search_r1_em(solution: str, ground_truth: Any) -> float:
    found = re.findall(r"<answer>(.*?)</answer>", solution, re.DOTALL)
    if not found:
        return 0.0
    targets = ground_truth["target"] if isinstance(ground_truth, dict) else ground_truth
    targets = [targets] if isinstance(targets, str) else list(targets)
    if squad_normalise(found[-1].strip()) not in {squad_normalise(str(t)) for t in targets}:
        return 0.0
    tags = max(solution.count("<answer>"), solution.count("</answer>"))
    return 0.25 if tags > 10 else 1.0
