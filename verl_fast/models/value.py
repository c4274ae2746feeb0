"""The critic: a transformer backbone with a scalar value head on every position."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from verl_fast.models.vision import model_inputs
from verl_fast.models.wrapping import wrapper_kind


def backbone_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a Hugging Face causal LM (its ``base_model``), or the model itself."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else model


class ValueModel(nn.Module):
    """Values ``[B, T]`` from ``model``: a token-classification model with one label is used as it is;
    any other model (e.g. a causal LM of any family) gets a linear head on its last hidden states,
    initialised to zero so the first values are 0 and the first GAE advantages are the returns."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        config = getattr(model, "config", None)
        self.token_classifier = "ForTokenClassification" in type(model).__name__
        if self.token_classifier:
            if getattr(config, "num_labels", 1) != 1:
                raise ValueError(f"a token-classification critic needs num_labels=1, got {config.num_labels}")
            self.backbone, self.head = None, None
        else:
            # a vision-language model's width is its language model's (``text_config``)
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            hidden = getattr(config, "hidden_size", None) or getattr(text, "hidden_size", None)
            if hidden is None:
                raise ValueError(f"cannot find hidden_size in the critic's config ({type(model).__name__})")
            # A model the user wrapped with FSDP gathers its top-level shards (embeddings, final
            # norm) only when it is called itself: go through it (its last hidden states, one
            # position's logits) instead of calling its backbone directly.
            self.backbone = None if wrapper_kind(model) is not None else backbone_of(model)
            self.head = nn.Linear(hidden, 1)
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
            param = next(model.parameters())
            self.head.to(device=param.device, dtype=param.dtype)

    def forward(self, input_ids, attention_mask, position_ids=None, **extra) -> torch.Tensor:
        """``extra``: a vision-language model's image keywords (``models/vision.model_inputs``)."""
        if self.token_classifier:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **extra)
            return out.logits[..., 0].float()
        if self.backbone is None:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False, output_hidden_states=True, logits_to_keep=1, **extra)
            return self.head(out.hidden_states[-1]).squeeze(-1).float()
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **extra)
        return self.head(out.last_hidden_state).squeeze(-1).float()


def response_values(critic: ValueModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_length: int, vision: Optional[Sequence[Any]] = None) -> torch.Tensor:
    """Values of the states in which each of the last ``response_length`` tokens is produced: the
    position before each token (as verl's critic reads them). ``[B, L]``. ``vision``: each row's
    prompt's images (a vision-language critic: its pixel values, patch grids and M-RoPE positions)."""
    if vision is not None:
        extra = model_inputs(critic.model, input_ids, attention_mask, vision)
    else:
        extra = {"position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0)}
    values = critic(input_ids=input_ids, attention_mask=attention_mask, **extra)
    return values[:, -response_length - 1 : -1]
