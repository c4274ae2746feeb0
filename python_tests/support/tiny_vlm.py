"""Tiny random-weight Qwen2-VL / Qwen2.5-VL models and their processor for tests (no hub), and
pictures of red squares.

    from tiny_vlm import build_vlm, save_tiny_vlm, square_image
    model, processor = build_vlm("qwen2_5_vl")
    path = save_tiny_vlm(tmp_path / "vlm", family="qwen2_vl")

The builders are ``verl_fast.models.random_vlm``'s (the example and benchmarks use them too).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Union

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from verl_fast.models import random_vlm  # noqa: E402

VLM_FAMILIES = random_vlm.FAMILIES
MAX_PIXELS = random_vlm.MAX_PIXELS
build_processor = random_vlm.build_processor


def build_vlm(family: str = "qwen2_vl", seed: int = 0):
    """``(model, processor)``: a float32 tiny VLM in eval mode."""
    return random_vlm.build(family, "tiny", seed)


def save_tiny_vlm(path: Union[str, Path], family: str = "qwen2_vl", seed: int = 0) -> Path:
    return random_vlm.save(path, family, "tiny", seed)


def square_image(count: int, size: int = 56, seed: int = 0):
    """An RGB picture of ``count`` (at most 9) red squares on white: the example's own pictures."""
    return _example().draw_squares(count, size, seed)


@functools.lru_cache(maxsize=1)
def _example():
    """examples/vlm_grpo/train.py as a module (its pictures, rows and reward)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "vlm_grpo" / "train.py"
    spec = importlib.util.spec_from_file_location("vlm_grpo_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
