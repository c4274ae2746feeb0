"""A vision-language model's processor: its image processor and tokenizer working as one, as the model
takes a prompt with images (``data/images.py`` reads and checks the images; this turns them into tokens and
pixel inputs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from verl_fast.records.prompts import VisionInputs


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

    def with_limits(self, limits: Any) -> "VisionProcessor":
        """Images resized within ``limits``' bounds (``data.images.ImageLimits``: those given; the processor's
        own otherwise)."""
        self.size = {k: v for k, v in (("shortest_edge", limits.min_pixels), ("longest_edge", limits.max_pixels))
                     if v is not None}
        return self

    def template(self, messages: List[Dict[str, Any]]) -> str:
        return self.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def apply_chat_template(self, messages: List[Dict[str, Any]], **kwargs: Any) -> Any:
        """The tokenizer's ``apply_chat_template`` with the processor's template (content lists with
        image items render each image as one ``image_token``)."""
        return self.tokenizer.apply_chat_template(messages, **{"chat_template": self.chat_template, **kwargs})

    def encode(self, text: str, images: Sequence[Any]) -> Tuple[List[int], VisionInputs]:
        """Token ids of ``text`` (one ``image_token`` per image) with each placeholder expanded to its
        image's tokens, and the images' inputs."""
        expanded, inputs = self.expand(text, images)
        return self.tokenizer(expanded, add_special_tokens=False)["input_ids"], inputs

    def expand(self, text: str, images: Sequence[Any]) -> Tuple[str, VisionInputs]:
        """``text`` (one ``image_token`` per image) with each placeholder repeated to its image's token
        count, and the images' inputs."""
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
            expanded += self.image_token * self.tokens_of(grid[k]) + piece
        return expanded, VisionInputs(out["pixel_values"].float(), grid, tuple(images))

    def tokens_of(self, grid_thw: Any) -> int:
        """The token count of an image of patch grid ``grid_thw`` (its patches, merged ``merge`` x ``merge``)."""
        return int(grid_thw.prod()) // self.merge ** 2

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
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text()).get("chat_template")
    return None
