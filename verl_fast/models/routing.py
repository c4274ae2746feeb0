"""MoE routing: recording which experts each token was routed to, and replaying that routing.

Qwen2-MoE and Qwen3-MoE route each token with a top-k router (``...TopKRouter``: softmax over the
experts' logits, the k largest, renormalised when ``norm_topk_prob``). Where rollout and training
compute the router's logits a little differently (another kernel, batch, precision), a token near a
tie goes to other experts in the training forward than in the rollout, and the update's importance
ratios then compare two different networks. Routing replay forces the training forward to use the
rollout's experts, while the weights of those experts stay the gate's softmax over the token's
logits (differentiable: the gate still learns).

- ``record(model)``: hooks on every router; each forward call's top-k indices, per layer.
- ``follow(model, routed, substitute)``: inside, each router takes the experts in ``routed``
  (``[B, T, layers, k]``, -1 where nothing was recorded: the router's own choice) when
  ``substitute``, and counts the tokens whose own top-k set differs from the recorded one either way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import torch
import torch.nn.functional as F

ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")  # the router classes this module drives
UNRECORDED = -1


def routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's top-k routers in layer order; a ValueError for a mixture-of-experts model of another
    family (its routers are not driven here), [] for a dense model."""
    found = [m for m in model.modules() if type(m).__name__ in ROUTERS]
    config = getattr(model, "config", None)
    if not found and (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)):
        raise ValueError(f"MoE routing replay supports Qwen2-MoE and Qwen3-MoE models, got model_type "
                         f"{getattr(config, 'model_type', type(model).__name__)!r}")
    return found


@dataclass
class Recording:
    """Per router, the ``[tokens, k]`` indices of each forward call, in call order."""

    calls: List[List[torch.Tensor]] = field(default_factory=list)

    def stacked(self, rows: int) -> torch.Tensor:
        """``[rows, T, layers, k]`` int16: the calls joined along time (a call covers ``rows x t`` tokens:
        the prefill's t = prompt width, then t = 1 per decoded token)."""
        layers = [torch.cat([c.reshape(rows, -1, c.shape[-1]) for c in calls], dim=1) for calls in self.calls]
        return torch.stack(layers, dim=2).to(torch.int16)


@contextlib.contextmanager
def record(model: torch.nn.Module) -> Iterator[Recording]:
    """Records every router's top-k indices (on the host) while the block runs."""
    found = routers(model)
    rec = Recording(calls=[[] for _ in found])

    def hook(index: int):
        def save(module, inputs, output):
            rec.calls[index].append(output[2].detach().to("cpu", torch.int64))
        return save

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(found)]
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


@dataclass
class Agreement:
    """What ``follow`` saw: per token (``[B, T]``), whether any layer's own top-k set differed from the
    recorded one, and which tokens had a recorded routing at all."""

    changed: Optional[torch.Tensor] = None
    recorded: Optional[torch.Tensor] = None

    def fraction(self, mask: Optional[torch.Tensor] = None) -> float:
        """Changed tokens over recorded ones (within ``mask [B, T]`` when given); 0.0 with none."""
        if self.changed is None:
            return 0.0
        counted = self.recorded if mask is None else self.recorded & mask.bool().to(self.recorded.device)
        total = int(counted.sum())
        return float((self.changed & counted).sum()) / total if total else 0.0


def _routed_forward(router: torch.nn.Module, layer: int, routed: torch.Tensor, substitute: bool, seen: Agreement):
    """The router's forward with the recorded experts of ``layer`` (module docstring)."""
    B, T = routed.shape[:2]

    def forward(hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden_states, router.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        _, own = torch.topk(probs, router.top_k, dim=-1)
        given = routed[:, :, layer, :].reshape(-1, router.top_k).to(device=own.device, dtype=torch.int64)
        if given.shape[0] != own.shape[0]:
            raise ValueError(f"routed experts cover {given.shape[0]} tokens, the forward has {own.shape[0]}")
        has = (given >= 0).all(-1)
        # the same set of experts, whatever their order: sorted indices compared
        differs = has & (own.sort(-1).values != given.sort(-1).values).any(-1)
        seen.changed = differs.view(B, T) | seen.changed.to(own.device)
        seen.recorded = has.view(B, T)
        indices = torch.where(has[:, None], given, own) if substitute else own
        weights = probs.gather(-1, indices)  # the gate's softmax on the experts taken: gradients reach it
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), indices

    return forward


@contextlib.contextmanager
def follow(model: torch.nn.Module, routed: torch.Tensor, substitute: bool) -> Iterator[Agreement]:
    """Routers that take ``routed [B, T, layers, k]`` (``substitute``) or only compare with it."""
    found = routers(model)
    if routed.dim() != 4 or routed.shape[2] != len(found):
        raise ValueError(f"routed experts must be [B, T, layers={len(found)}, k], got {list(routed.shape)}")
    seen = Agreement(changed=torch.zeros(routed.shape[:2], dtype=torch.bool))
    for layer, router in enumerate(found):
        router.forward = _routed_forward(router, layer, routed, substitute, seen)  # found before the class's
    try:
        yield seen
    finally:
        for router in found:
            del router.forward
