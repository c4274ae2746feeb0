"""A Hugging Face sequence-classification model as the reward: the score of (prompt, response)."""

from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence

import torch

from verl_fast.rewards.interface import RewardFunction, RewardInput


class RewardModel(RewardFunction):
    """Scores each prompt + response with ``model`` (``AutoModelForSequenceClassification`` with one
    label), its own tokenizer and chat template when it has one; batched, no gradients. The
    reward model may be of a different family than the actor."""

    name = "reward_model"

    def __init__(self, model, tokenizer, batch_size: int = 16, max_length: int = 2048,
                 device: Optional[torch.device] = None):
        if getattr(model.config, "num_labels", 1) != 1:
            raise ValueError(f"a reward model must have one output label, got num_labels={model.config.num_labels}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device or next(model.parameters()).device
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.pad_token_id is None:
            raise ValueError("reward model: its tokenizer has neither a pad nor an end-of-sequence token, so a batch "
                             "cannot be padded; set pad_token in its tokenizer_config.json")
        if getattr(model.config, "pad_token_id", None) is None:
            # transformers' sequence-classification heads find each row's last token through the config's
            # pad_token_id and refuse batches without it: the tokenizer's pad (its EOS when it has none)
            model.config.pad_token_id = tokenizer.pad_token_id

    @classmethod
    def from_pretrained(cls, path: str, load_kwargs: Optional[dict] = None, **kwargs) -> "RewardModel":
        """``path``: a local folder or a Hub name (HF cache, ``HF_HUB_OFFLINE`` respected);
        ``load_kwargs`` (``attn_implementation``, ``trust_remote_code``) go to transformers."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from verl_fast.models.loading import pretrained

        load_kwargs = dict(load_kwargs or {})
        model = pretrained(AutoModelForSequenceClassification, path, "reward_fn.model_name", num_labels=1,
                           **load_kwargs)
        tokenizer = pretrained(AutoTokenizer, path, "reward_fn.model_name",
                               trust_remote_code=load_kwargs.get("trust_remote_code", False))
        return cls(model, tokenizer, **kwargs)

    @classmethod
    def for_model(cls, model, fallback_tokenizer: Optional[Any] = None, **kwargs) -> "RewardModel":
        """A sequence-classification model passed as the reward as it is (seed 000 §2.1: any
        PreTrainedModel, of any family). Its tokenizer is the one saved beside it (the folder in
        ``model.name_or_path``), else ``fallback_tokenizer`` (the actor's) when every id of it is a
        row of the model's embedding; otherwise a ValueError says to wrap it in RewardModel(model, tokenizer)."""
        folder = getattr(model, "name_or_path", "") or ""
        if folder and os.path.isdir(folder) and _has_tokenizer(folder):
            from transformers import AutoTokenizer

            return cls(model, AutoTokenizer.from_pretrained(folder), **kwargs)
        rows = model.get_input_embeddings().num_embeddings
        if fallback_tokenizer is not None and len(fallback_tokenizer) <= rows:
            return cls(model, fallback_tokenizer, **kwargs)
        raise ValueError(f"reward_fn: the {type(model).__name__} has no tokenizer saved beside it (name_or_path="
                         f"{folder!r}) and the actor's tokenizer does not fit its {rows}-row embedding: pass "
                         "reward_fn=RewardModel(model, its_tokenizer)")

    def _text(self, s: RewardInput) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": s.prompt}, {"role": "assistant", "content": s.response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return s.prompt + s.response

    @torch.no_grad()
    def __call__(self, samples: Sequence[RewardInput]) -> List[float]:
        scores: List[float] = []
        for i in range(0, len(samples), self.batch_size):
            texts = [self._text(s) for s in samples[i : i + self.batch_size]]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.max_length).to(self.device)
            logits = self.model(**enc).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def is_sequence_classifier(obj: Any) -> bool:
    """Whether ``obj`` is a transformers ``...ForSequenceClassification`` model (a score head on a
    decoder or encoder), which a reward can be built from directly."""
    try:
        from transformers import PreTrainedModel
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    except ImportError:  # pragma: no cover
        return False
    names = set(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values())
    return isinstance(obj, PreTrainedModel) and type(obj).__name__ in names
