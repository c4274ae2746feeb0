"""Images of vision-language prompts: read, checked, resized and turned into the model's inputs.

Two dataset formats are read:
- verl's: an ``images`` column (a list of bytes, paths, PIL images or ``{"bytes": ..., "path": ...}``
  dicts, as parquet stores them), ``<image>`` placeholders in the prompt's text, one per image;
- TRL's: an ``image`` (one) or ``images`` (a list) column with conversational prompts whose content
  lists hold ``{"type": "image"}`` items (or plain text: the images then open the first user turn).

``VisionProcessor`` pairs an image processor (Qwen2-VL's: patches of 14 pixels, 2 x 2 merged into one
token) with the tokenizer: the chat template renders each image as one ``<|image_pad|>``, which is
expanded to the image's token count before tokenizing, and the prompt's ``VisionInputs`` (pixel
values, the patch grid of each image, the RGB images themselves) travel with its token ids.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from verl_fast.records.prompts import VisionInputs  # noqa: F401  (the record, where readers build it)


VERL_PLACEHOLDER = "<image>"
# modes that are pictures, converted to RGB; others (16-bit / float depth maps, ...) are refused
PICTURE_MODES = frozenset({"RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr"})


@dataclass(frozen=True)
class ImageLimits:
    """``trainer.image_min_pixels`` / ``image_max_pixels`` (the resize bounds; None: the processor's)
    and ``image_max_input_pixels`` (larger pictures are refused before decoding)."""

    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    max_input_pixels: int = 64 * 1024 * 1024


def read_image(value: Any, limits: ImageLimits = ImageLimits()):
    """An RGB PIL image from bytes, a path, a PIL image or a
    ``{"bytes": ..., "path": ...}`` dict. ``ValueError`` in one line when it cannot be read, is larger
    than ``limits.max_input_pixels`` or is not a picture (a depth map's 16-bit or float mode)."""
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (bytes, bytearray)):
        image = _open(io.BytesIO(value), "bytes")
    elif isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"image file {value} not found")
        image = _open(path, str(value))
    else:
        raise ValueError(f"an image must be bytes, a path, a PIL image or a {{'bytes': ...}} dict, "
                         f"got {type(value).__name__}")
    width, height = image.size
    if width * height > limits.max_input_pixels:
        raise ValueError(f"image of {width}x{height} pixels is larger than trainer.image_max_input_pixels="
                         f"{limits.max_input_pixels}")
    if width < 1 or height < 1:
        raise ValueError(f"image of {width}x{height} pixels is empty")
    if image.mode not in PICTURE_MODES:
        raise ValueError(f"image mode {image.mode} is not a picture (RGB, RGBA, L, P, CMYK, ... are read)")
    try:
        return image.convert("RGB")
    except OSError as e:  # a truncated file fails only when its pixels are decoded
        raise ValueError(f"image cannot be decoded: {e}") from None


def _open(source: Any, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(source)
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"cannot read the image {what[:60]}: {type(e).__name__}") from None
    return image


def row_images(row: Dict[str, Any]) -> Optional[List[Any]]:
    """The raw images of a row (verl's ``images``, TRL's ``image`` / ``images``), or None without any."""
    if row.get("images") is not None:
        value = row["images"]
        return list(value) if isinstance(value, (list, tuple)) else [value]
    if row.get("image") is not None:
        return [row["image"]]
    return None


def vision_messages(messages: List[Dict[str, Any]], count: int) -> List[Dict[str, Any]]:
    """Messages whose content lists hold exactly ``count`` image items: verl's ``<image>``
    placeholders split out of string contents; TRL's content lists kept; with no image item
    anywhere, ``count`` of them open the first user turn (as TRL places a row's image)."""
    out, found = [], 0
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            parts: List[Dict[str, Any]] = []
            for k, piece in enumerate(content.split(VERL_PLACEHOLDER)):
                if k:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
        elif isinstance(content, list):
            parts = [dict(c) if isinstance(c, dict) else {"type": "text", "text": str(c)} for c in content]
        else:
            raise ValueError(f"a message's content must be a string or a list, got {type(content).__name__}")
        found += sum(p.get("type") == "image" for p in parts)
        out.append({**m, "content": parts})
    if found == 0:
        first = next((i for i, m in enumerate(out) if m.get("role") == "user"), 0)
        out[first] = {**out[first], "content": [{"type": "image"}] * count + out[first]["content"]}
    elif found != count:
        raise ValueError(f"the prompt has {found} image placeholders for {count} images")
    return out


class VisionProcessor:
    """An image processor and a tokenizer working as one (what transformers' Qwen2-VL processor does,
    without its video processor, which needs torchvision): ``encode(text, images)`` -> token ids with
    each image's placeholder expanded, and the ``VisionInputs``."""

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: Optional[str] = None,
                 image_token: str = "<|image_pad|>"):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token = getattr(tokenizer, "image_token", None) or image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == getattr(tokenizer, "unk_token_id", -1):
            raise ValueError(f"the tokenizer has no {self.image_token} token: not a Qwen2-VL-style tokenizer")
        self.merge = int(getattr(image_processor, "merge_size", 1))
        self.size: Dict[str, int] = {}  # the resize bounds that override the processor's (with_limits)

    @classmethod
    def of(cls, processor: Any) -> Optional["VisionProcessor"]:
        """A transformers processor (one with ``image_processor`` and ``tokenizer``) or a VisionProcessor
        as a VisionProcessor; None for a plain tokenizer."""
        if isinstance(processor, cls):
            return processor
        if hasattr(processor, "image_processor") and hasattr(processor, "tokenizer"):
            return cls(processor.image_processor, processor.tokenizer, getattr(processor, "chat_template", None),
                       getattr(processor, "image_token", None) or "<|image_pad|>")
        return None

    @classmethod
    def from_pretrained(cls, path: str) -> "VisionProcessor":
        """The folder's image processor and tokenizer (its chat_template.jinja / .json too)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(AutoImageProcessor.from_pretrained(path), tokenizer, _saved_template(Path(path)))

    def save_pretrained(self, path: str) -> None:
        """Image processor, tokenizer and chat template into ``path`` (AutoProcessor reads them back)."""
        self.image_processor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self.chat_template:
            (Path(path) / "chat_template.jinja").write_text(self.chat_template)

    def with_limits(self, limits: ImageLimits) -> "VisionProcessor":
        """Images resized within ``limits``' bounds (those given; the processor's own otherwise)."""
        self.size = {k: v for k, v in (("shortest_edge", limits.min_pixels), ("longest_edge", limits.max_pixels))
                     if v is not None}
        return self

    def template(self, messages: List[Dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  chat_template=self.chat_template)

    def encode(self, text: str, images: Sequence[Any]) -> Tuple[List[int], VisionInputs]:
        """Token ids of ``text`` (one ``image_token`` per image) with each placeholder expanded to its
        image's tokens, and the images' inputs."""
        found = text.count(self.image_token)
        if found != len(images):
            raise ValueError(f"the templated prompt has {found} {self.image_token} for {len(images)} images")
        size = self.size
        if size and len(size) < 2:  # one bound given: the processor's own for the other
            own = self.image_processor.size
            size = {"shortest_edge": own.shortest_edge, "longest_edge": own.longest_edge, **size}
        out = self.image_processor(images=list(images), return_tensors="pt", **({"size": size} if size else {}))
        grid = out["image_grid_thw"].long()
        pieces = text.split(self.image_token)
        expanded = pieces[0]
        for k, piece in enumerate(pieces[1:]):
            expanded += self.image_token * (int(grid[k].prod()) // self.merge ** 2) + piece
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        return ids, VisionInputs(out["pixel_values"].float(), grid, tuple(images))

    # the tokenizer's face, for code that takes either
    def __getattr__(self, name: str) -> Any:
        if name in ("image_processor", "tokenizer", "size"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)


def _saved_template(path: Path) -> Optional[str]:
    import json

    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text()).get("chat_template")
    return None


def encode_row(processor: VisionProcessor, messages: List[Dict[str, Any]], raw: List[Any],
               limits: ImageLimits) -> Tuple[List[int], str, VisionInputs]:
    """(token ids, templated text, images' inputs) of one row's prompt ``messages`` and raw images."""
    images = [_read(v, k, limits) for k, v in enumerate(raw)]
    text = processor.template(vision_messages(messages, len(images)))
    ids, inputs = processor.encode(text, images)
    return ids, text, inputs


def _read(value: Any, k: int, limits: ImageLimits):
    try:
        return read_image(value, limits)
    except ValueError as e:
        raise ValueError(f"images[{k}]: {e}") from None

