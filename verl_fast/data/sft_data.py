"""SFT rows as token ids and a loss mask, in TRL's dataset formats:

- ``messages``: a chat, ``[{"role", "content"}, ...]``, through the tokenizer's chat template; the loss
  on the assistant turns (the text each assistant turn adds to the rendered conversation, its
  end-of-turn tokens included).
- ``prompt`` / ``completion``: conversational (chat messages: the prompt rendered with its generation
  prompt, the completion as the text the template adds after it) or plain strings (concatenated, EOS
  appended); the loss on the completion.
- ``text``: plain text, EOS appended; the loss on every token but the first.

Rows longer than ``max_length`` tokens are cut to it.

A row with images (TRL's ``images`` / ``image`` column, or verl's ``<image>`` placeholders) and a
vision-language processor: ``messages`` or conversational ``prompt`` / ``completion`` whose content lists
hold ``{"type": "image"}`` items (none: the images open the first user turn); each image's placeholder
is expanded to its token count and the example carries the images' ``VisionInputs``. A cut that would
drop image tokens is refused, naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from verl_fast.data import readers
from verl_fast.data.images import ImageLimits, read_images, row_images, vision_messages
from verl_fast.models.vision_processor import VisionProcessor
from verl_fast.records.prompts import VisionInputs


@dataclass
class SFTExample:
    """One training sequence: its token ids and 1 where the loss reads the token."""

    ids: List[int]
    loss_mask: List[int]
    vision: Optional[VisionInputs] = None  # its images (a vision-language row), None for text


def _render(tokenizer: Any, messages: Sequence[Dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def chat_spans(tokenizer: Any, messages: Sequence[Dict[str, Any]], where: str) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered chat and the character spans of its assistant turns (each: the text between the
    conversation before it, with the generation prompt, and the conversation through it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: chat messages need a tokenizer with a chat template")
    text = _render(tokenizer, messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        head = _render(tokenizer, messages[:k], True) if k else ""
        through = _render(tokenizer, messages[: k + 1], False)
        if not (text.startswith(through) and through.startswith(head)):
            raise ValueError(f"{where}: the chat template does not render turn {k} as a prefix of the whole "
                             "conversation, so its tokens cannot be told apart; give prompt / completion strings")
        spans.append((len(head), len(through)))
    return text, spans


def _tokens(tokenizer: Any, text: str, spans: List[Tuple[int, int]]) -> Tuple[List[int], List[int]]:
    """``text``'s ids and a mask of the tokens that start inside a span."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _with_eos(tokenizer: Any, ids: List[int], mask: List[int]) -> Tuple[List[int], List[int]]:
    eos = tokenizer.eos_token_id
    if eos is None or (ids and ids[-1] == eos):
        return ids, mask
    return ids + [eos], mask + [1]


def encode_row(tokenizer: Any, row: Dict[str, Any], where: str) -> SFTExample:
    """One row (module docstring) as an SFTExample."""
    if "messages" in row:
        readers.check_prompt(row["messages"], where, "messages")  # rows given in Python: not read by readers
        text, spans = chat_spans(tokenizer, row["messages"], where)
        ids, mask = _tokens(tokenizer, text, spans)
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):
            text, spans = chat_spans(tokenizer, list(prompt) + list(completion), where)
            cut = len(_render(tokenizer, prompt, True))
            ids, mask = _tokens(tokenizer, text, [(max(a, cut), b) for a, b in spans if b > cut])
        elif isinstance(prompt, str) and isinstance(completion, str):
            ids, mask = _with_eos(tokenizer, *_tokens(tokenizer, prompt + completion,
                                                      [(len(prompt), len(prompt) + len(completion))]))
        else:
            raise ValueError(f"{where}: prompt and completion must both be strings or both chat messages")
    elif "text" in row:
        ids, mask = _with_eos(tokenizer, *_tokens(tokenizer, row["text"], [(0, len(row["text"]))]))
    else:
        raise ValueError(f"{where}: an SFT row needs messages, prompt / completion, or text (TRL's formats), got "
                         f"keys {sorted(row)}")
    return SFTExample(ids, mask)


def encode_vision_row(vision: VisionProcessor, row: Dict[str, Any], raw: List[Any], limits: ImageLimits,
                      where: str) -> SFTExample:
    """A conversational row with images (module docstring) as an SFTExample with its ``VisionInputs``."""
    images = read_images(raw, limits)
    if "messages" in row:
        text, spans = chat_spans(vision, vision_messages(row["messages"], len(images)), where)
    elif isinstance(row.get("prompt"), list) and isinstance(row.get("completion"), list):
        prompt = vision_messages(row["prompt"], len(images))
        text, spans = chat_spans(vision, prompt + list(row["completion"]), where)
        cut = len(_render(vision, prompt, True))
        spans = [(max(a, cut), b) for a, b in spans if b > cut]
    else:
        raise ValueError(f"{where}: an SFT row with images needs messages, or prompt / completion chat messages, "
                         f"got keys {sorted(row)}")
    expanded, inputs = vision.expand(text, images)
    ids, mask = _tokens(vision, expanded, _shifted(spans, text, vision, inputs))
    return SFTExample(ids, mask, inputs)


def _shifted(spans: List[Tuple[int, int]], text: str, vision: VisionProcessor,
             inputs: VisionInputs) -> List[Tuple[int, int]]:
    """``spans`` of ``text`` moved onto its expanded text: each image placeholder before a position
    grows by its image's tokens less one."""
    token = vision.image_token
    marks, start = [], text.find(token)
    while start >= 0:
        marks.append(start)
        start = text.find(token, start + len(token))
    grow = [len(token) * (vision.tokens_of(g) - 1) for g in inputs.image_grid_thw]

    def moved(pos: int) -> int:
        return pos + sum(g for m, g in zip(marks, grow) if m < pos)

    return [(moved(a), moved(b)) for a, b in spans]


def _column(row: Dict[str, Any], path: str, where: str) -> Any:
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{where}: no column {path} (algorithm.sft_columns; the row's keys: {sorted(row)})")
        node = node[part]
    return node


def remap(row: Dict[str, Any], columns: Dict[str, str], where: str) -> Dict[str, Any]:
    """The row's ``columns`` (ours -> its column or dotted path) under our names; a string prompt so read
    becomes the user's message and its string completion the assistant's (verl's SFT rendering)."""
    if not columns:
        return row
    out = {ours: _column(row, path, where) for ours, path in columns.items()}
    if isinstance(out.get("prompt"), str) and isinstance(out.get("completion"), str):
        out["prompt"] = [{"role": "user", "content": out["prompt"]}]
        out["completion"] = [{"role": "assistant", "content": out["completion"]}]
    return out


def encode(tokenizer: Any, rows: Sequence[Dict[str, Any]], max_length: int, columns: Optional[Dict[str, str]] = None,
           truncation: str = "right", limits: ImageLimits = ImageLimits()) -> List[SFTExample]:
    """Every row (its ``columns`` read under our names) as an SFTExample, cut to ``max_length`` tokens
    (``truncation="error"``: a longer row refused, naming it); a row with no trained token (after the
    cut) is refused, naming it. A row with images needs ``tokenizer`` to be a vision-language processor
    (images resized within ``limits``)."""
    out, vision = [], VisionProcessor.of(tokenizer)
    for i, row in enumerate(rows):
        where, raw = f"SFT row {i}", row_images(row) if isinstance(row, dict) else None
        mapped = remap(row, columns or {}, where)
        if raw is None:
            e = encode_row(tokenizer, mapped, where)
        elif vision is None:
            raise ValueError(f"{where}: the row has images, but the tokenizer is not a vision-language processor "
                             "(give the model's processor, e.g. AutoProcessor.from_pretrained)")
        else:
            try:
                e = encode_vision_row(vision, mapped, raw, limits, where)
            except ValueError as err:
                raise ValueError(err if str(err).startswith(where) else f"{where}: {err}") from None
        if truncation == "error" and len(e.ids) > max_length:
            raise ValueError(f"SFT row {i}: {len(e.ids)} tokens, more than algorithm.sft_max_length={max_length} "
                             "(verl's data.max_length; data.truncation=right cuts it)")
        if e.vision is not None and vision.image_token_id in e.ids[max_length:]:
            raise ValueError(f"SFT row {i}: {len(e.ids)} tokens, more than algorithm.sft_max_length={max_length}, "
                             "and the cut would drop image tokens; raise the limit or shrink the images "
                             "(trainer.image_max_pixels)")
        e = replace(e, ids=e.ids[:max_length], loss_mask=e.loss_mask[:max_length])
        if not any(e.loss_mask[1:]):  # the first token has nothing before it to be predicted from
            raise ValueError(f"SFT row {i}: no assistant / completion token within algorithm.sft_max_length="
                             f"{max_length} (its length: {len(e.ids)} tokens)")
        out.append(e)
    return out
