"""The actor trained with megatron-core (``actor.strategy: megatron``): log-probs and updates for
RLTrainer through megatron-core's pipeline schedules, DDP and distributed optimizer
(``training.py``).

- Model: ``gpt_model.MegatronGPT`` built from the HF actor's config, its weights
  loaded from the HF actor's state dict (each rank its shards). The HF actor stays the rollout
  model of HF generate: after each update the Megatron weights are written back into it
  (``export_to``); a vLLM engine takes them straight from the Megatron shards instead.
- Log-probs and entropy: the output layer is swapped, for the duration of a forward, for
  ``linear_logprobs(hidden, output_layer weight shard, labels, tp_group=TP group)`` on the final
  (normed) hidden states of the positions that predict a response token only (the prompt's are never
  projected): vocab-parallel, the [tokens, vocab] logits never exist. Padded vocabulary
  rows get a -1e4 bias, so the softmax runs over the real vocabulary only, as in the HF model.
- MoE routing replay: where the rollout recorded routing, both forwards' routers take it
  (``actor.routing_replay``) or only compare with it (``routing_replay.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from verl_fast.records.experience import Experience
from verl_fast.ops.logprobs import linear_logprobs
from verl_fast.strategies.megatron.gpt_model import MegatronGPT, Parallel, init_parallel_state
from verl_fast.strategies.megatron.routing_replay import Replay
from verl_fast.strategies.megatron.training import DTYPES, MegatronTrained

_PAD_LOGIT = -1e4  # exp(-1e4 - max) is exactly 0 in float32: padded vocabulary rows drop out


class _Head:
    """Swaps a GPTModel output layer's forward for the fused log-prob head while active."""

    def __init__(self, layer, tp_group, vocab: int, temperature: float):
        self.layer, self.tp_group, self.vocab, self.temperature = layer, tp_group, vocab, temperature
        self.index = self.labels = None  # [L, n] positions and the global ids they predict, set by ``select``

    def select(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """The next forward projects, of the rows ``tokens [n, S]``, the positions ``positions [n, L]``."""
        self.index = positions.t()
        self.labels = tokens.gather(1, positions + 1).t()  # position s predicts token s + 1

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
        rows = torch.arange(hidden.shape[1], device=hidden.device)
        hidden = hidden[self.index, rows]  # [S, n, H] -> [L, n, H]
        logp, entropy = linear_logprobs(hidden, weight, self.labels, self.temperature, True,
                                        bias=self._padding_bias(weight), tp_group=self.tp_group)
        return torch.stack([logp, entropy], dim=-1), None  # [L, n, 2]; the model returns it as [n, L, 2]

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

        def around(tokens, positions):
            head.select(tokens, positions)
            return head.active()

        return around

    def _replay(self, exp: Experience):
        """Where the rollout recorded routing: the routers take it (``actor.routing_replay``) or only
        compare with it (``routing_replay.py``)."""
        return None if exp.routed_experts is None else Replay(self.model.chunks, self.cfg.actor.routing_replay)

    # ---- what the strategy (strategy.py) calls

    def logprobs(self, exp: Experience, micro: List[torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        """[N, L] float32 log-probs of the response tokens, on every rank (sent from the last stage)."""
        return self.response_outputs(exp, micro, self._around(temperature), self._replay(exp))

    def forward_backward(self, exp: Experience, micro: List[torch.Tensor], loss_fn) -> List[Dict]:
        """The gradient of ``loss_fn(logp, entropy, sub) -> (loss, stats)`` over ``micro`` (``step``
        applies it); each micro-batch's stats (every rank)."""
        return super().forward_backward(exp, micro, loss_fn, self._around(self.cfg.rollout.temperature or 1.0),
                                        self._replay(exp))

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
