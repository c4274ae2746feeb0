"""Vision-language models (Qwen2-VL / Qwen2.5-VL through ``AutoModelForImageTextToText``): what the
passes over their rows need beside the token ids.

A micro-batch's rows carry their prompts' ``VisionInputs`` (``data/images.py``); ``model_inputs``
turns them into the forward's keywords: the pixel values and patch grids of the rows' images in row
order (the model scatters the vision tower's output onto the ``<|image_pad|>`` positions in that
order), the token types, and the 3-D rotary positions (M-RoPE: an image's tokens take (t, h, w)
positions, the text after it continues from the image's largest) computed by the model's own
``get_rope_index`` over the left-padded rows -- so a row's positions do not depend on its padding
or on which rows share its micro-batch, and text-only rows get plain positions in all three.
``images_once`` gives the same forward with each distinct ``VisionInputs`` of a micro-batch through the
vision tower once (a prompt's samples share their prompt's): the features are gathered back to every
row's placeholders inside the forward.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from verl_fast.models.wrapping import hf_module, peft_base

#: peft's exclude_modules for LoRA on the language model only (the vision tower and its merger)
VISION_MODULES = r".*\bvisual\b.*"


def is_vision_model(model: Any) -> bool:
    """A Qwen2-VL-style model: a vision tower and an image token in its config."""
    config = getattr(hf_module(model), "config", None)
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def check_run(cfg: Any, model: Any) -> None:
    """A run with a vision-language processor: what it supports, each refusal one line."""
    if not is_vision_model(model):
        raise ValueError("a vision-language processor was given, but the actor is not a vision-language model "
                         "(Qwen2-VL / Qwen2.5-VL, AutoModelForImageTextToText); give its tokenizer instead")
    refused = [(cfg.actor.strategy == "megatron", "actor.strategy=megatron", "actor.strategy: none"),
               (cfg.trainer.async_mode != "off", f"trainer.async_mode={cfg.trainer.async_mode}",
                "trainer.async_mode: off")]
    for bad, what, use in refused:
        if bad:
            raise ValueError(f"a vision-language actor is not supported with {what}; use {use}")


def check_rows(items: Sequence[Any], world: int) -> None:
    """With several processes every row has images: FSDP2 gathers the vision tower's shards when a
    micro-batch has images, and a rank whose micro-batch held none would skip that collective (a hang)."""
    if world > 1:
        bare = next((i for i, item in enumerate(items) if getattr(item, "vision", None) is None), None)
        if bare is not None:
            raise ValueError(f"encoded row {bare} has no images: with {world} processes a vision-language run needs "
                             "images in every row (a rank without any would skip the vision tower's collectives); "
                             "drop the text-only rows or run one process")


def _core(model: torch.nn.Module) -> torch.nn.Module:
    """The inner model that owns ``visual`` and ``get_rope_index`` (under peft / FSDP1 wrapping)."""
    return peft_base(hf_module(model)).model


def placeholder_ids(model: Any) -> List[int]:
    """The token ids the forward replaces by vision features (image and video placeholders): never
    sampled, so that every one in a sequence stands for an image it was given."""
    return config_placeholder_ids(hf_module(model).config)


def config_placeholder_ids(config: Any) -> List[int]:
    """``placeholder_ids`` of a model's config (a model not loaded: a folder's ``AutoConfig``)."""
    return [i for i in (config.image_token_id, getattr(config, "video_token_id", None)) if i is not None]


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """The vision tower's parameters frozen (``actor.freeze_vision_tower``); returns how many."""
    frozen = 0
    for p in _core(model).visual.parameters():
        if p.requires_grad:
            p.requires_grad_(False)
            frozen += 1
    return frozen


def image_inputs(model: torch.nn.Module, input_ids: torch.Tensor,
                 vision: Sequence[Optional[Any]], pixels: bool = True) -> Dict[str, torch.Tensor]:
    """``mm_token_type_ids`` of rows ``input_ids [B, T]`` and, when a row has images (``vision``: one
    ``VisionInputs`` or None a row), their ``pixel_values`` (unless not ``pixels``) / ``image_grid_thw`` in
    row order, on the rows' device: what ``generate`` takes (it computes the 3-D positions itself)."""
    if len(vision) != input_ids.shape[0]:
        raise ValueError(f"vision must hold one entry per row: {input_ids.shape[0]} rows, {len(vision)} entries")
    out = {"mm_token_type_ids": (input_ids == hf_module(model).config.image_token_id).int()}
    rows = [v for v in vision if v is not None]
    if rows and pixels:
        out["pixel_values"] = torch.cat([v.pixel_values for v in rows]).to(input_ids.device)
    if rows:
        out["image_grid_thw"] = torch.cat([v.image_grid_thw for v in rows]).to(input_ids.device)
    return out


def model_inputs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 vision: Sequence[Optional[Any]]) -> Dict[str, torch.Tensor]:
    """The forward's keywords for rows ``input_ids [B, T]`` (left-padded) whose prompts' images are
    ``vision`` (one ``VisionInputs`` or None a row): ``position_ids [3, B, T]``, ``mm_token_type_ids``
    and, when a row has images, ``pixel_values`` / ``image_grid_thw``."""
    out = image_inputs(model, input_ids, vision)
    out["position_ids"], _ = rope_positions(model, input_ids, attention_mask, out)
    return out


def distinct_images(vision: Sequence[Optional[Any]]) -> Tuple[List[Any], List[int]]:
    """The rows' distinct ``VisionInputs`` (the same object: a prompt's samples share it) in first-seen
    order, and for each image of the rows, in row order, its index among the distinct ones' images."""
    firsts: List[Any] = []
    start: Dict[int, int] = {}
    index: List[int] = []
    count = 0
    for v in vision:
        if v is None:
            continue
        if id(v) not in start:
            start[id(v)] = count
            firsts.append(v)
            count += v.num_images
        index.extend(range(start[id(v)], start[id(v)] + v.num_images))
    return firsts, index


@contextlib.contextmanager
def images_once(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                vision: Sequence[Optional[Any]]) -> Iterator[Dict[str, torch.Tensor]]:
    """``model_inputs``'s keywords with the pixel values and grids of the rows' distinct ``VisionInputs``
    only (``distinct_images``); inside, the model's image features (its ``get_image_features``, called by
    its forward) are gathered back to every row's images in row order, so a prompt's samples run its
    images through the vision tower once. The rows' forward is the plain one's; a trained tower's
    gradients sum over the rows that share an image, as they would over copies."""
    firsts, index = distinct_images(vision)
    if len(index) == sum(v.num_images for v in firsts):  # no row shares another's images
        yield model_inputs(model, input_ids, attention_mask, vision)
        return
    out = image_inputs(model, input_ids, vision, pixels=False)  # every row's grids: its positions
    out["position_ids"], _ = rope_positions(model, input_ids, attention_mask, out)
    out["pixel_values"] = torch.cat([v.pixel_values for v in firsts]).to(input_ids.device)
    out["image_grid_thw"] = torch.cat([v.image_grid_thw for v in firsts]).to(input_ids.device)
    core = _core(model)
    features_of = core.get_image_features

    def gathered(pixel_values, image_grid_thw=None, **kwargs):
        features = features_of(pixel_values, image_grid_thw, **kwargs)
        features.pooler_output = tuple(features.pooler_output[i] for i in index)  # one tensor per image
        return features

    core.get_image_features = gathered  # the instance's, over the class's method, for this forward only
    try:
        yield out
    finally:
        del core.get_image_features


def rope_positions(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   inputs: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The model's own ``get_rope_index`` over rows ``input_ids [B, T]`` (left-padded) with their
    ``image_inputs``: the M-RoPE ``position_ids [3, B, T]`` and each row's rope delta [B] (how far a text
    token after the prompt sits beyond its text position: all three components of its position are that
    text position plus the delta), on the rows' device. The index is computed on host copies: it reads
    every row back to the host (on a GPU, two waits for the device a row, where one copy waits once)."""
    host = [None if t is None else t.cpu() for t in (input_ids, inputs["mm_token_type_ids"],
                                                     inputs.get("image_grid_thw"), attention_mask)]
    positions, deltas = _core(model).get_rope_index(host[0], host[1], image_grid_thw=host[2], attention_mask=host[3])
    return positions.to(input_ids.device), deltas.reshape(-1).to(input_ids.device)


def decode_unsupported(model: torch.nn.Module) -> Optional[str]:
    """Why the static-cache decode cannot serve this vision-language model (None when it can): it takes
    the decode steps' positions from the model's rope index."""
    if not callable(getattr(_core(model), "get_rope_index", None)):
        return f"{type(hf_module(model)).__name__} has no get_rope_index (the decode steps' M-RoPE positions)"
    return None
