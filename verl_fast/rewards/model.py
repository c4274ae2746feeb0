"""A Hugging Face sequence-classification model as the reward: the score of (prompt, response)."""

from __future__ import annotations

from typing import List, Optional, Sequence

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
