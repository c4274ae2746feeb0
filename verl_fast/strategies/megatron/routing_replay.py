"""MoE routing replay for the Megatron actor (``actor.routing_replay``; the HF actor's is
``models/routing.py``, which also says why).

Each of megatron-core's ``TopKRouter``s has its ``routing`` swapped, for one forward, for one that
routes every token to its recorded experts (its own top-k where nothing was recorded) with the
weights megatron-core's softmax gives them (differentiable: the gate still learns), and compares its
own top-k set with the recorded one. Token order: the schedule's rows are the experience's rows
rotated past their left padding and cut to the forward's width (``training.rotate_to_start``), the
router sees them sequence-first, ``[s, b]`` flattened, every token of the rows (no sequence
parallelism: the strategy sets none; a router given fewer tokens raises). The all-gather dispatcher
routes each rank's own tokens before sending them to their experts, so expert parallelism changes
nothing here. A router's recorded layer is its global layer number: every layer is sparse
(``gpt_model.model_spec``).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from verl_fast.models.routing import UNRECORDED


def _routers(chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


class Replay:
    """The routers of ``chunks`` over one pass of the schedule: ``follow`` around each micro-batch's
    forward; ``substitute``: take the recorded experts (else only compare with them)."""

    def __init__(self, chunks: List[torch.nn.Module], substitute: bool):
        self.routers = _routers(chunks)
        self.substitute = substitute
        self.given: Optional[torch.Tensor] = None  # [s * b, layers, k] of the forward in flight
        self.changed: Dict[int, torch.Tensor] = {}  # micro-batch -> [b, s] bool, this stage's layers
        self.recorded: Dict[int, torch.Tensor] = {}  # micro-batch -> [b, s] bool
        self._micro = -1
        for router in self.routers:
            cfg = router.config
            if (router.score_function != "softmax" or cfg.moe_router_group_topk or cfg.moe_router_topk_scaling_factor
                    or cfg.moe_expert_capacity_factor is not None or router.expert_bias is not None):
                raise ValueError("actor.routing_replay with actor.strategy=megatron replays plain softmax top-k "
                                 "routers only (no group-limited routing, scaling, token dropping or expert bias)")

    @contextlib.contextmanager
    def follow(self, micro: int, routed: torch.Tensor, mask: torch.Tensor) -> Iterator[None]:
        """Around the forward of micro-batch ``micro``: ``routed [b, s, layers, k]`` in the forward's
        rows, ``mask [b, s]`` its attention mask (the tokens the metric counts)."""
        layers = self.routers[0].config.num_layers if self.routers else routed.shape[2]
        if routed.dim() != 4 or routed.shape[2] != layers:
            raise ValueError(f"routed experts must be [N, T, layers={layers}, k], got {list(routed.shape)}")
        b, s = routed.shape[:2]
        self.given = routed.transpose(0, 1).reshape(s * b, *routed.shape[2:]).to(torch.int64)
        self._micro = micro
        self.recorded[micro] = (routed != UNRECORDED).all(-1).all(-1) & mask.bool()
        self.changed.setdefault(micro, torch.zeros(b, s, dtype=torch.bool, device=routed.device))
        for router in self.routers:
            router.routing = self._routing(router)  # found before the class's method
        try:
            yield
        finally:
            for router in self.routers:
                del router.routing
            self.given = None

    def _routing(self, router: torch.nn.Module):
        layer = router.layer_number - 1

        def routing(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
            s, b = logits.shape[:2]
            logits = logits.view(-1, router.config.num_moe_experts)
            given = self.given
            if given.shape[0] != logits.shape[0]:
                raise ValueError(f"recorded routing covers {given.shape[0]} tokens, the router of layer {layer} "
                                 f"has {logits.shape[0]} (sequence parallelism?)")
            given = given[:, layer]
            pre_softmax = router.config.moe_router_pre_softmax
            # the router's own choice, as megatron-core makes it
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits) if pre_softmax else logits
            own = torch.topk(scores, k=router.topk, dim=1).indices
            has = (given != UNRECORDED).all(-1)
            differs = has & (own.sort(-1).values != given.sort(-1).values).any(-1)  # as sets
            self.changed[self._micro] |= differs.view(s, b).t()
            indices = torch.where(has[:, None], given, own) if self.substitute else own
            if pre_softmax:  # softmax over every expert, taken on the chosen ones
                probs = scores.gather(1, indices)
            else:  # softmax over the chosen experts' logits: the renormalised form
                probs = torch.softmax(logits.gather(1, indices), dim=-1, dtype=torch.float32).type_as(logits)
            routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
            routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool()
            return routing_probs, routing_map

        return routing

    def fractions(self, n_micro: int, pp_group=None) -> List[float]:
        """Per micro-batch, the share of its recorded tokens (within its attention mask) whose routing
        any layer would have changed; the pipeline stages' layers combined over ``pp_group``."""
        out = []
        for micro in range(n_micro):
            changed = self.changed.get(micro)
            if changed is None:
                out.append(0.0)
                continue
            if pp_group is not None:
                changed = changed.to(torch.int32)
                dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=pp_group)  # any stage's layers
                changed = changed.bool()
            counted = self.recorded[micro]
            total = int(counted.sum())
            out.append(float((changed & counted).sum()) / total if total else 0.0)
        return out
