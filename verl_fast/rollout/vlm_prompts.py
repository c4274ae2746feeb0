"""A vision-language prompt as a vLLM request: token ids and the prompt's pictures.

Our processor expands each image's ``<|image_pad|>`` to the image's token count before the trainer
sees the ids (``data/images.py``). vLLM expands placeholders itself, from the pictures its own processor
reads (the engine's folder holds ours, with the run's resize bounds): so a request carries the ids with
each run of placeholders folded back to one token, and vLLM's expansion of it must give back the ids
the trainer scores (``check_expansion``, after generation: the engine then conditioned on exactly them).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence


def fold_placeholders(ids: Sequence[int], image_token: int) -> List[int]:
    """``ids`` with every run of ``image_token`` folded into one token."""
    out: List[int] = []
    for t in ids:
        if t != image_token or not out or out[-1] != image_token:
            out.append(t)
    return out


def image_request(request: Any, vision: Any, image_token: int, index: int) -> Dict[str, Any]:
    """vLLM's prompt for ``prompts[index]`` (``request``: ``{"prompt_token_ids": ...}``) with its images
    (``VisionInputs``); ValueError (one line) when its placeholders do not match its images."""
    if not isinstance(request, dict):
        raise ValueError(f"prompts[{index}] has images: give it as token ids (with the images' placeholders "
                         "expanded, as the trainer's processor writes them), not as text")
    folded = fold_placeholders(request["prompt_token_ids"], image_token)
    runs = folded.count(image_token)
    if runs != len(vision.images):
        raise ValueError(f"prompts[{index}] has {runs} image placeholder runs for {len(vision.images)} images")
    return {"prompt_token_ids": folded, "multi_modal_data": {"image": list(vision.images)}}


def check_expansion(ids: Sequence[int], expanded: Optional[Sequence[int]], index: int) -> None:
    """Refuses a request whose placeholders vLLM expanded otherwise than our processor (``ids``): its
    completion was conditioned on other tokens than the trainer scores."""
    ours = [int(t) for t in ids]
    if expanded is not None and list(expanded) != ours:
        raise ValueError(f"prompts[{index}]: vLLM expanded the image placeholders to {len(expanded)} prompt tokens, "
                         f"the trainer's processor to {len(ours)}: the engine's image processor resizes otherwise "
                         "(build the engine from the trainer's processor folder, with the same "
                         "trainer.image_min_pixels / image_max_pixels)")
