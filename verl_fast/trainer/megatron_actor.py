"""The actor trained with megatron-core (``actor.strategy: megatron``): log-probs and updates for
RLTrainer through megatron-core's pipeline schedules, DDP and distributed optimizer
(``megatron_training.py``).

- Model: ``models/megatron_model.MegatronGPT`` built from the HF actor's config, its weights
  loaded from the HF actor's state dict (each rank its shards). The HF actor stays the rollout
  model of HF generate: after each update the Megatron weights are written back into it
  (``export_to``); a vLLM engine takes them straight from the Megatron shards instead.
- Log-probs and entropy: the output layer is swapped, for the duration of a forward, for
  ``linear_logprobs(hidden, output_layer weight shard, labels, tp_group=TP group)`` on the final
  (normed) hidden states: vocab-parallel, the [tokens, vocab] logits never exist. Padded vocabulary
  rows get a -1e4 bias, so the softmax runs over the real vocabulary only, as in the HF model.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from verl_fast.models.megatron_model import MegatronGPT, Parallel, init_parallel_state
from verl_fast.ops.logprobs import linear_logprobs
from verl_fast.trainer.experience import Experience
from verl_fast.trainer.megatron_training import DTYPES, MegatronTrained

_PAD_LOGIT = -1e4  # exp(-1e4 - max) is exactly 0 in float32: padded vocabulary rows drop out


class _Head:
    """Swaps a GPTModel output layer's forward for the fused log-prob head while active."""

    def __init__(self, layer, tp_group, vocab: int, temperature: float):
        self.layer, self.tp_group, self.vocab, self.temperature = layer, tp_group, vocab, temperature
        self.labels = None  # [S, n] global token ids, set before each forward

    def _padding_bias(self, weight: torch.Tensor):
        rows = weight.shape[0]
        real = max(0, min(self.vocab - dist.get_rank(self.tp_group) * rows, rows))
        if real == rows:
            return None
        bias = torch.zeros(rows, dtype=weight.dtype, device=weight.device)
        bias[real:] = _PAD_LOGIT
        return bias

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        weight = self.layer.weight if weight is None else weight  # shared embeddings come as ``weight``
        logp, entropy = linear_logprobs(hidden, weight, self.labels, self.temperature, True,
                                        bias=self._padding_bias(weight), tp_group=self.tp_group)
        return torch.stack([logp, entropy], dim=-1), None  # [S, n, 2]

    @contextlib.contextmanager
    def active(self):
        self.layer.forward = self.forward
        try:
            yield self
        finally:
            del self.layer.forward


class MegatronActor(MegatronTrained):
    """Builds the Megatron model from ``hf_model`` and trains it; collective over the world."""

    def __init__(self, hf_model: torch.nn.Module, cfg: Any):
        a = cfg.actor
        self.cfg = cfg
        par = Parallel.from_actor_config(a)
        init_parallel_state(par)
        self.hf_config = hf_model.config
        model = MegatronGPT(hf_model.config, par, DTYPES[a.dtype])
        model.load_hf(hf_model.state_dict())
        super().__init__(model, a.lr, a.weight_decay, a.max_grad_norm)

    def _around(self, temperature: float):
        """The fused log-prob head, active around each forward of the last stage (None elsewhere)."""
        last = self.model.chunks[-1].module
        layer = getattr(last, "output_layer", None) if last.post_process else None
        if layer is None:
            return None
        head = _Head(layer, self.tp_group, self.model.spec.vocab_size, temperature)

        def around(tokens):
            head.labels = tokens.roll(-1, dims=1).t()  # [S, n]: position s predicts token s + 1
            return head.active()

        return around

    # ---- the trainer's interface

    def logprobs(self, exp: Experience, micro: List[torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        """[N, L] float32 log-probs of the response tokens, on every rank (sent from the last stage)."""
        return self.response_outputs(exp, micro, self._around(temperature))

    def train_mini_batch(self, exp: Experience, micro: List[torch.Tensor], loss_fn) -> Tuple[List[Dict], float]:
        """One optimiser step over ``micro``; ``loss_fn(logp, entropy, sub) -> (loss, stats)``. Returns
        each micro-batch's stats (every rank) and the gradient norm."""
        return super().train_mini_batch(exp, micro, loss_fn, self._around(self.cfg.rollout.temperature or 1.0))

    def export_to(self, hf_model: torch.nn.Module) -> None:
        """Writes the trained weights into the HF model (every rank; collective over the group holding
        every weight)."""
        self.model.to_hf(dict(hf_model.named_parameters()))

    def hf_state(self) -> Dict[str, torch.Tensor]:
        """The trained weights under HF names, on the CPU, on the first rank of the group holding every
        weight (``{}`` on the others); collective over that group. Nothing is kept after the call."""
        first = dist.get_rank(self.model.weights_group()) == 0
        device = next(iter(self.model.named_parameters().values())).device
        out = {n: torch.empty(shape, dtype=self.model.spec.dtype, device=device)
               for n, shape in self.model.logical.items()} if first else {}
        self.model.to_hf(out, only_first=True)
        return {n: t.cpu() for n, t in out.items()}

    def weight_source(self) -> Tuple[Any, Dict[str, torch.Tensor]]:
        """The source of a rollout engine's weight sync: the Megatron shards as a layout over the world
        (each rank its TP / PP shard, data-parallel replicas included) and this rank's parameters by the
        layout's names. Collective over the world."""
        return self.model.group_layout(), self.model.named_parameters()

    @staticmethod
    def model_parallel_group():
        """The ranks that hold one copy of the model between them (and the same data)."""
        from megatron.core import parallel_state as ps

        return ps.get_model_parallel_group()
