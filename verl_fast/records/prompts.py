"""The dataset's rows as the step takes them: a prompt ready for rollout (``PromptRow``), the prompts of
one rollout call (``PromptBatch``), a preference pair (``PreferencePair``). ``verl_fast.data`` builds
them (and exports them under its own name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class VisionInputs:
    """One prompt's images as the model takes them."""

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch] float32
    image_grid_thw: torch.Tensor  # [images, 3] int64: each image's (t, h, w) patch grid
    images: Tuple[Any, ...]  # the RGB PIL images (rewards that receive them; engines that take pictures)

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


@dataclass
class PromptRow:
    """One prompt ready for rollout."""

    prompt_ids: List[int]
    prompt_text: str  # after the chat template
    ground_truth: Any = None
    data_source: str = ""
    extra_info: Dict[str, Any] = field(default_factory=dict)
    columns: Dict[str, Any] = field(default_factory=dict)  # every field of the source row, as given
    vision: Optional[VisionInputs] = None  # the prompt's images (data/images.py reads them), None for a text prompt


class PromptBatch(list):
    """The prompts of one rollout call, as ``RolloutOperator.get_generation_kwargs`` sees them: a list
    of PromptRow (``batch[0]``, ``for row in batch``) that also answers column access:
    ``batch["task_type"]`` is that field of every row, in order (any column of the source rows, or a
    PromptRow attribute such as ``data_source``)."""

    def __getitem__(self, key):
        if not isinstance(key, str):
            return super().__getitem__(key)
        values = []
        for i, row in enumerate(self):
            if key in row.columns:
                values.append(row.columns[key])
            elif key in PromptRow.__dataclass_fields__ and key != "columns":
                values.append(getattr(row, key))
            else:
                raise KeyError(f"batch[{key!r}]: row {i} has no column {key!r}; its columns: {sorted(row.columns)}")
        return values


@dataclass
class PreferencePair:
    """One DPO example: token ids of the prompt and of both responses (EOS appended)."""

    prompt: str
    chosen: str
    rejected: str
    prompt_ids: List[int]
    chosen_ids: List[int]
    rejected_ids: List[int]
    vision: Optional[VisionInputs] = None  # the prompt's images, None for a text prompt
