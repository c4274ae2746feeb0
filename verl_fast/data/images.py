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
from typing import Any, Dict, List, Optional, Tuple

from verl_fast.models.vision_processor import VisionProcessor
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


def encode_row(processor: VisionProcessor, messages: List[Dict[str, Any]], raw: List[Any],
               limits: ImageLimits) -> Tuple[List[int], str, VisionInputs]:
    """(token ids, templated text, images' inputs) of one row's prompt ``messages`` and raw images."""
    images = read_images(raw, limits)
    text = processor.template(vision_messages(messages, len(images)))
    ids, inputs = processor.encode(text, images)
    return ids, text, inputs


def read_images(raw: List[Any], limits: ImageLimits) -> List[Any]:
    """A row's raw images as RGB PIL images (``read_image``); an error names the image's index."""
    out = []
    for k, value in enumerate(raw):
        try:
            out.append(read_image(value, limits))
        except ValueError as e:
            raise ValueError(f"images[{k}]: {e}") from None
    return out

