"""What the Megatron actor and critic share: a ``MegatronGPT`` wrapped in megatron-core's DDP with its
distributed optimizer, and one pass of megatron-core's pipeline schedule over our micro-batches
(their distributed checkpoints: ``dist_checkpoint.py``).

- Positions: megatron-core's rotary embedding numbers positions from 0, so each left-padded row is
  rotated to start at its first real token (its trailing padding is then harmless under the causal mask).
- One optimiser step per mini-batch (``forward_backward`` then ``step``): ``get_forward_backward_func`` runs our micro-batches
  (variable shapes, their sizes sent between stages); the loss of a micro-batch is its share of
  the mini-batch loss (normalised by the DP-global counts divided by the DP size), multiplied by
  the number of micro-batches because the schedule divides by it; DDP averages over DP ranks.
  Gradient clipping is megatron-core's (norm over every model-parallel shard). AdamW as megatron-core
  sets it up: no weight decay on biases and norms.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from verl_fast.records.experience import Experience
from verl_fast.strategies.megatron.gpt_model import MegatronGPT
from verl_fast.strategies.megatron.grad_norm import use_foreach_grad_norm
from verl_fast.strategies.megatron.routing_replay import Replay

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# loss_fn(*columns, sub) -> (loss, result): columns are the model's output features at the response
# positions, each [n, L]; result is what the schedule hands back for the micro-batch
LossFn = Callable[..., Tuple[torch.Tensor, Any]]


def rotation(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[n, S]`` gather index that rotates each left-padded row left to start at its first real token."""
    width = attention_mask.shape[1]
    pads = attention_mask.long().argmax(-1)
    return (torch.arange(width, device=attention_mask.device) + pads[:, None]) % width


def rotate_to_start(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int):
    """Rows rotated left past their left padding: ``(tokens [n, S], positions [n, L])`` where
    ``positions[i, j]`` is the position whose output predicts response token j of row i."""
    n, width = input_ids.shape
    pads = attention_mask.long().argmax(-1)  # first real token of each (left-padded) row
    tokens = input_ids.gather(1, rotation(attention_mask))
    first = width - response_length - 1 - pads  # the response starts at width - L, minus the padding
    positions = first[:, None] + torch.arange(response_length, device=input_ids.device)
    return tokens, positions


class MegatronTrained:
    """``model`` under DDP and megatron-core's distributed optimizer; collective over the world."""

    def __init__(self, model: MegatronGPT, lr: float, weight_decay: float, max_grad_norm: float):
        if model.spec.is_moe and model.par.tp > 1:  # forwards (conversion, checkpoints) work; training does not
            raise ValueError(f"actor.strategy=megatron: a mixture-of-experts model trains with "
                             f"tensor_model_parallel_size={model.par.tp} only under sequence parallelism in "
                             "megatron-core, which verl_fast does not enable; use tensor_model_parallel_size=1 "
                             "with expert_model_parallel_size / pipeline_model_parallel_size")
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model = model
        self.par = model.par
        dtype = model.spec.dtype
        config = model.config
        config.variable_seq_lengths = True  # micro-batches keep their own lengths; shapes go between stages
        config.finalize_model_grads_func = finalize_model_grads
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        model.chunks = [DistributedDataParallel(config, ddp, c) for c in model.chunks]
        use_foreach_grad_norm()  # without Apex / TE megatron-core's clipping norm waits on the host per tensor
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=max_grad_norm, params_dtype=dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_distributed_optimizer=True),
            model.chunks)
        self.zero_grad()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.last_stage_rank = ps.get_pipeline_model_parallel_last_rank()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")

    # ---- one pass of the schedule over micro-batches

    def _run(self, exp: Experience, micro: List[torch.Tensor], forward_only: bool, loss_fn: LossFn,
             around: Optional[Callable[[torch.Tensor, torch.Tensor], ContextManager]] = None,
             replay: Optional[Replay] = None) -> List[Any]:
        """Runs the schedule; on the last stage ``loss_fn(*columns, sub)`` gives each micro-batch's loss
        and result. ``around(tokens, positions)``: a context the model's forward runs in (tokens
        ``[n, S]``, response positions ``[n, L]``) under which the last stage outputs the response
        positions only; without it every position's output is taken at ``positions``. ``replay``: the
        MoE routers follow the experience's recorded routing (``routing_replay.py``).
        Returns the results (last stage only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n_micro = len(micro)
        batches = []
        for i, idx in enumerate(micro):
            sub = exp.select(idx.to(exp.input_ids.device)).to(self.device)  # the loss meets the outputs there
            tokens, positions = rotate_to_start(sub.input_ids, sub.attention_mask, sub.response_length)
            width = int(positions.max()) + 2  # nothing after the last response token is needed
            routed = None
            if replay is not None and sub.routed_experts is not None:  # the tokens' experts, in their new places
                index = rotation(sub.attention_mask)
                experts = sub.routed_experts.gather(1, index[..., None, None].expand_as(sub.routed_experts))
                routed = (experts[:, :width], sub.attention_mask.gather(1, index)[:, :width])
            batches.append((i, sub, tokens[:, :width].to(self.device), positions.to(self.device), routed))

        def forward_step(data_iterator, model):
            i, sub, tokens, positions, routed = next(data_iterator)
            n, width = tokens.shape
            pos = torch.arange(width, device=self.device).expand(n, width)
            # no mask: the layers are causal and SDPAttention asks torch for its causal kernel
            with around(tokens, positions) if around is not None else contextlib.nullcontext(), \
                    replay.follow(i, *routed) if routed is not None else contextlib.nullcontext():
                out = model(tokens, pos, None)  # last stage: [n, L, features] under around, else [n, S, ...]

            def loss_func(output):
                if around is None:
                    output = output.gather(1, positions[..., None].expand(-1, -1, output.shape[-1]))
                columns = [output[..., k] for k in range(output.shape[-1])]  # each [n, L]
                loss, result = loss_fn(*columns, sub)
                return loss * n_micro, result  # the schedule divides every micro-batch's loss by n_micro

            return out, loss_func

        chunks = self.model.chunks
        iterators = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=n_micro, seq_length=exp.input_ids.shape[1], micro_batch_size=max(len(m) for m in micro),
            forward_only=forward_only)

    def response_outputs(self, exp: Experience, micro: List[torch.Tensor],
                         around: Optional[Callable[[torch.Tensor, torch.Tensor], ContextManager]] = None,
                         replay: Optional[Replay] = None) -> torch.Tensor:
        """[N, L] float32: the model's first output feature at each response position, on every rank
        (sent from the last stage); no gradient."""
        for c in self.model.chunks:
            c.eval()
        out = torch.zeros(exp.response_mask.shape, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            results = self._run(exp, micro, True, lambda first, *rest: (first.sum() * 0, first.float()), around,
                                replay)
        if self.is_last_stage:
            for idx, rows in zip(micro, results):  # [n, L of the micro-batch]
                out[idx.to(self.device), : rows.shape[1]] = rows
        if self.par.pp > 1:
            dist.broadcast(out, src=self.last_stage_rank, group=self.pp_group)
        return out.to(exp.response_mask.device)

    def forward_backward(self, exp: Experience, micro: List[torch.Tensor], loss_fn: LossFn,
                         around: Optional[Callable[[torch.Tensor, torch.Tensor], ContextManager]] = None,
                         replay: Optional[Replay] = None) -> List[Dict]:
        """The gradient of ``loss_fn(*columns, sub) -> (loss, stats)`` over ``micro`` in the grad buffers
        (zero before: ``step`` zeroes them; one call per step, as the schedule's end reduces them over
        the data-parallel ranks). Returns each micro-batch's stats (every rank; sent from the last
        stage); with ``replay`` also its ``routing_changed_frac`` (``routing_replay.Replay.fractions``)."""
        for c in self.model.chunks:
            c.train()
        stats = self._run(exp, micro, False, loss_fn, around, replay) if micro else []
        stats = [{k: float(v) for k, v in s.items()} for s in stats]  # read once every micro-batch is queued
        if self.par.pp > 1:
            box = [stats]
            dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.pp_group)
            stats = box[0]
        if replay is not None:  # tokens whose experts the training forward would have changed
            fractions = replay.fractions(len(micro), self.pp_group if self.par.pp > 1 else None)
            stats = [{**s, "routing_changed_frac": f} for s, f in zip(stats, fractions)]
        return list(stats)

    def step(self) -> float:
        """megatron-core's clipped optimiser step on the reduced gradient, then the buffers zeroed; the
        gradient norm (nan where it was not finite and the step was skipped)."""
        ok, grad_norm, _ = self.optimizer.step()
        self.zero_grad()
        return float(grad_norm or 0.0) if ok else float("nan")

    def zero_grad(self) -> None:
        for c in self.model.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
