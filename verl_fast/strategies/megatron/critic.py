"""The PPO critic trained with megatron-core (``critic.strategy: megatron``, beside a Megatron actor):
a ``MegatronGPT`` whose last stage ends in a scalar value head instead of the vocabulary projection,
trained by RLTrainer's ``update_critic`` through megatron-core's schedules, DDP and distributed
optimizer (``training.py``).

- Layout: the actor's (megatron-core's ``parallel_state`` is one per process): the same tensor /
  pipeline / virtual-pipeline sizes, data parallel over the rest of the world.
- Weights: from the HF critic (``models/value.ValueModel``), each rank reading only its shards: the
  backbone's ``model.*`` tensors, and its head, a token-classification model's ``score`` or the
  linear head ValueModel puts on a causal LM, both as ``score.weight`` / ``score.bias``. The head is
  replicated on every TP rank. A token-classification model's dropout before ``score`` is not
  applied (the Megatron critic has none).
- Values: the value of the state in which each response token is produced (the position before it),
  as the HF critic reads them (``models/value.response_values``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from verl_fast.records.experience import Experience
from verl_fast.models.value import ValueModel
from verl_fast.strategies.megatron.gpt_model import VALUE_HEAD, MegatronGPT, Parallel, init_parallel_state
from verl_fast.strategies.megatron.training import DTYPES, MegatronTrained


def hf_critic_state(critic: ValueModel) -> Tuple[Dict[str, torch.Tensor], bool]:
    """The HF critic's tensors under the names the Megatron critic's layout reads (``model.*`` and
    ``score.*``), and whether its head has a bias."""
    if not isinstance(critic, ValueModel):
        raise TypeError(f"critic.strategy=megatron needs the critic as a ValueModel, got {type(critic).__name__}")
    inner = critic.model.state_dict()
    state = {k: v for k, v in inner.items() if k.startswith("model.")}
    head = critic.model.score if critic.token_classifier else critic.head
    state[VALUE_HEAD[0]] = head.weight
    if head.bias is not None:
        state[VALUE_HEAD[1]] = head.bias
    return state, head.bias is not None


class MegatronCritic(MegatronTrained):
    """Builds the Megatron critic from the HF ``critic`` and trains it; collective over the world."""

    def __init__(self, critic: ValueModel, cfg: Any):
        c = cfg.critic
        par = Parallel.from_actor_config(cfg.actor)
        init_parallel_state(par)
        state, bias = hf_critic_state(critic)
        model = MegatronGPT(critic.model.config, par, DTYPES[c.dtype], value_head=True, value_bias=bias)
        model.load_hf(state)
        super().__init__(model, c.lr, c.weight_decay, c.max_grad_norm)

    def values(self, exp: Experience, micro: List[torch.Tensor]) -> torch.Tensor:
        """[N, L] float32 values at the response positions, on every rank (sent from the last stage)."""
        return self.response_outputs(exp, micro)

    def optimizer_step(self) -> float:
        """Applies what ``forward_backward(exp, micro, loss_fn(values, sub))`` (``MegatronTrained``'s)
        accumulated: the critic's clipped step; the gradient norm."""
        return self.step()

    def to_hf(self) -> Dict[str, torch.Tensor]:
        """The whole critic under HF names (``model.*``, ``score.*``) on every rank (collective over the
        model-parallel group)."""
        return self.model.to_hf()
