"""Reading dataset files with bounds a careless or hostile file cannot get past, and the rows' shape
checked before any model loads, each error naming the file and line (or row).

- A dataset file is a regular file: a FIFO, a device or a socket is refused (it would block, or
  never end), checked on the opened descriptor (opened non-blocking, so a FIFO does not hang the open).
- A JSONL line is at most ``MAX_LINE_BYTES`` (read in bounded pieces: a 100 MB line is refused
  after reading one piece past the limit), a ``.json`` file at most ``MAX_JSON_BYTES``; text is
  UTF-8 (the line of a bad byte is named).
- ``check_row``: a row has a prompt (a string, or chat messages each with a string ``content``), or a
  preference pair's or an SFT row's fields (an SFT ``messages``: a non-empty list of such messages); ``reward_model`` is a mapping; a ground truth under a misspelt key
  (``groundtruth``, ``groundTruth``, ``ground-truth``) is refused naming it, rather than reaching the
  reward as None.
- ``Rows``: the rows of a file, each with where it came from (``path:line`` or ``path row N``), so a
  later error (an overlong prompt) names it too.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Optional

MAX_LINE_BYTES = 16 << 20
MAX_JSON_BYTES = 1 << 30
_PIECE = 1 << 20


class Rows(list):
    """Rows (dicts) with ``where(i)``: the file and line (or row number) row ``i`` came from."""

    def __init__(self, rows: List[Any], places: List[str]) -> None:
        super().__init__(rows)
        self._places = places

    def where(self, i: int) -> str:
        return self._places[i]


def where(rows: Any, i: int) -> str:
    """Where row ``i`` of ``rows`` came from: ``path:line`` for a file's rows, else ``row i``."""
    return rows.where(i) if isinstance(rows, Rows) and len(rows) == len(rows._places) else f"row {i}"


def open_regular(path: Path, what: str = "dataset") -> BinaryIO:
    """``path`` opened for reading in binary, refused unless it is a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open would wait for a writer
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise ValueError(f"{what} {path} is {kind}: give a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _text(raw: bytes, path: Path, line: int) -> str:
    """``raw`` (starting at line ``line`` of ``path``) as UTF-8 text."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line + raw.count(b"\n", 0, e.start)
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise ValueError(f"{path}:{at}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}); "
                         "save the file as UTF-8") from None


def _parse(text: str, path: Path, line: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = line + e.lineno - 1
        raise ValueError(f"{path}:{at}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}:{line}: the JSON nests too deeply") from None


def _lines(f: BinaryIO, path: Path):
    """(number, bytes) of each line, none longer than MAX_LINE_BYTES."""
    number = 0
    while True:
        number += 1
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise ValueError(f"{path}:{number}: a line longer than {MAX_LINE_BYTES >> 20} MiB; a JSONL row is "
                             "one line of at most that")
        yield number, line


def read_jsonl(path: Path) -> Rows:
    """One JSON object per non-empty line; errors name the file and the line number."""
    rows, places = [], []
    with open_regular(path) as f:
        for number, raw in _lines(f, path):
            text = _text(raw, path, number)
            if not text.strip():
                continue
            row = _parse(text.rstrip("\r\n"), path, number)
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object (a row), got {type(row).__name__}")
            check_row(row, f"{path}:{number}")
            rows.append(row)
            places.append(f"{path}:{number}")
    return Rows(rows, places)


def read_json(path: Path) -> Rows:
    """A .json file: a list of rows, or one row."""
    with open_regular(path) as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"{path} is larger than {MAX_JSON_BYTES >> 30} GiB: use JSONL or parquet for a dataset "
                         "this size")
    data = _parse(_text(raw, path, 1), path, 1)
    rows = data if isinstance(data, list) else [data]
    return checked(rows, str(path))


def checked(rows: List[Any], source: str) -> Rows:
    """``rows`` (of the file ``source``) each checked by ``check_row`` as ``source row N``."""
    places = [f"{source} row {i + 1}" for i in range(len(rows))]
    for row, place in zip(rows, places):
        if not isinstance(row, dict):
            raise ValueError(f"{place}: expected a mapping (a row), got {type(row).__name__}")
        check_row(row, place)
    return Rows(rows, places)


_TRUTH_SPELLINGS = {"groundtruth", "ground_truth", "ground-truth", "groundtruths"}
# the other row forms: preference pairs (TRL's implicit prompt; webgpt_comparisons' columns, two spellings)
# and SFT's chats and plain text (sft_data.py)
_OTHER_FORMS = ({"chosen", "rejected"}, {"question", "answer_1", "answer_2"}, {"question", "answer_0", "answer_1"},
                {"messages"}, {"text"})


def _misspelt_truth(mapping: Dict[str, Any]) -> Optional[str]:
    for key in mapping:
        if isinstance(key, str) and key != "ground_truth" and key.lower().replace(" ", "_") in _TRUTH_SPELLINGS:
            return key
    return None


def check_row(row: Dict[str, Any], place: str) -> None:
    """The row's shape (see the module docstring); errors start with ``place``."""
    if "prompt" not in row and not any(keys <= set(row) for keys in _OTHER_FORMS):
        raise ValueError(f"{place}: a row needs a 'prompt' field (verl format), got keys {sorted(map(str, row))}")
    if "prompt" in row:
        check_prompt(row["prompt"], place)
    if "messages" in row:  # an SFT chat
        check_prompt(row["messages"], place, "messages")
    check_truth(row, place)


def check_truth(row: Dict[str, Any], place: str = "") -> None:
    """``reward_model`` a mapping, and no ground truth under a misspelt key (errors start with
    ``place``, when given)."""
    at = f"{place}: " if place else ""
    reward = row.get("reward_model")
    if reward is not None and not isinstance(reward, dict):
        raise ValueError(f"{at}reward_model must be a mapping such as {{\"ground_truth\": ...}}, got {reward!r:.80}")
    for mapping, prefix in ((row, ""), (reward or {}, "reward_model.")):
        key = _misspelt_truth(mapping)
        if key is not None:
            raise ValueError(f"{at}{prefix}{key}: the ground truth's key is reward_model.ground_truth (or a "
                             "top-level ground_truth / answer); rename it")


def ground_truth(row: Dict[str, Any]) -> Any:
    """A row's ground truth: ``reward_model.ground_truth``, else a top-level ``ground_truth`` or
    ``answer`` (None: none)."""
    reward = row.get("reward_model") or {}
    truth = reward.get("ground_truth") if isinstance(reward, dict) else None
    return row.get("ground_truth", row.get("answer")) if truth is None else truth


def require_truth(rows: List[Any], key: str) -> None:
    """Refuses, naming the first such row, rows without a ground truth for a reward (``key``) that
    scores against one (it would score them 0, or fail after the models load)."""
    for i, row in enumerate(rows):
        if isinstance(row, dict) and ground_truth(row) is None:
            raise ValueError(f"{where(rows, i)}: {key} scores against a ground truth, and this row has none "
                             "(reward_model.ground_truth, ground_truth or answer)")


def check_prompt(prompt: Any, place: str, key: str = "prompt") -> None:
    """A prompt (``key``: the row's field) is a string or a non-empty list of chat messages, each with
    a string ``content``; the ``messages`` of an SFT row must be such a list."""
    if isinstance(prompt, str) and key == "prompt":
        return
    if not isinstance(prompt, list) or not prompt:
        kinds = "a string or a non-empty list" if key == "prompt" else "a non-empty list"
        raise ValueError(f"{place}: {key} must be {kinds} of chat messages, got {type(prompt).__name__} {prompt!r:.80}")
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{place}: {key}[{j}] must be a chat message with a string 'content' "
                             f"({{'role': ..., 'content': ...}}), got {message!r:.80}")
