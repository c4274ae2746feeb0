"""A megatron-core ``GPTModel`` built from a Hugging Face config, and its weights moved to and from
Hugging Face names through the resharding layouts (``ops/reshard/megatron.py``).

The model uses megatron-core's local layer spec (no Transformer Engine): RMSNorm, SwiGLU MLP,
grouped-query attention with rotary embeddings; Qwen2's QKV bias and Qwen3's per-head q/k norms. Its
core attention is ``megatron_attention.SDPAttention`` (torch's fused attention kernels).
With a virtual pipeline (``vpp`` chunks per stage) chunk ``v`` of stage ``p`` is virtual stage
``v * pp + p`` of ``pp * vpp`` equal stages, megatron-core's interleaved order.

Weights: each rank plans, in its own process, the copy from the HF tensors its shards need into
its parameters (it reads nothing else). The way back (rollout weights, HF export) is one
distributed plan over the model-parallel group: every rank ends with the whole HF model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

import torch
import torch.distributed as dist

from verl_fast.ops.reshard.api import reshard
from verl_fast.ops.reshard.hf import hf_layout
from verl_fast.ops.reshard.layout import Layout, PhysTensor, replicated
from verl_fast.ops.reshard.megatron import default_padded_vocab, megatron_stage_tensors
from verl_fast.ops.reshard.spec import ModelSpec, logical_shapes

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Parallel:
    """Megatron's model-parallel sizes (data parallelism is what remains of the world)."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    ep: int = 1

    @staticmethod
    def from_actor_config(a) -> "Parallel":
        return Parallel(a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                        a.virtual_pipeline_model_parallel_size, a.expert_model_parallel_size)

    @property
    def chunks(self) -> int:
        return self.vpp or 1


def init_parallel_state(par: Parallel) -> bool:
    """Uses ``megatron.core.parallel_state`` as the user set it up (its sizes must match ``par``), or
    initialises it. Returns True when it initialised the groups here."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        have = Parallel(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                        ps.get_virtual_pipeline_model_parallel_world_size(),
                        ps.get_expert_model_parallel_world_size())
        for key, mine, theirs in (("tensor", par.tp, have.tp), ("pipeline", par.pp, have.pp),
                                  ("virtual_pipeline", par.vpp, have.vpp), ("expert", par.ep, have.ep)):
            if mine != theirs:
                raise ValueError(f"actor.{key}_model_parallel_size={mine} but megatron.core.parallel_state is "
                                 f"already initialised with {theirs}; make them equal")
        return False
    if not dist.is_initialized():
        raise ValueError("actor.strategy=megatron needs torch.distributed: run under torchrun (or call "
                         "torch.distributed.init_process_group first)")
    world = dist.get_world_size()
    if world % (par.tp * par.pp):
        raise ValueError(f"the world size {world} must be a multiple of tensor_model_parallel_size * "
                         f"pipeline_model_parallel_size = {par.tp * par.pp}")
    ps.initialize_model_parallel(par.tp, par.pp, virtual_pipeline_model_parallel_size=par.vpp,
                                 expert_model_parallel_size=par.ep)
    return True


def model_spec(hf_config, dtype: torch.dtype) -> ModelSpec:
    spec = ModelSpec.from_hf_config(hf_config, dtype=dtype)
    if spec.family not in DENSE_FAMILIES:
        raise ValueError(f"actor.strategy=megatron supports model_type {DENSE_FAMILIES}, got {spec.family!r}")
    if spec.o_bias or spec.mlp_bias:
        raise ValueError("actor.strategy=megatron: attention output / MLP biases (attention_bias or mlp_bias in "
                         "the HF config) are not supported by the local layer spec mapping; use strategy fsdp2")
    rope_theta(hf_config)  # raises on scaled rotary embeddings
    return spec


def rope_theta(hf_config) -> float:
    """The rotary base; scaled variants (YaRN, Llama-3's) are refused: the local spec has none of them."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"actor.strategy=megatron: rotary scaling {kind!r} is not supported; use strategy fsdp2")
    return float(rope.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)


def transformer_config(hf_config, spec: ModelSpec, par: Parallel):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = spec.dtype
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.intermediate_size,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)), add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        # no fused kernels: the local spec runs plain torch on any device
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp, expert_model_parallel_size=par.ep,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # perform_initialization stays on although the weights are overwritten: without it megatron-core
        # never marks its parameters tensor-parallel, and the gradient norm skips every TP rank but 0
        use_cpu_initialization=not torch.cuda.is_available())


class MegatronGPT:
    """The model chunks of this rank and what moves weights in and out of them."""

    def __init__(self, hf_config, par: Parallel, dtype: torch.dtype = torch.float32):
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from verl_fast.models.megatron_attention import with_sdpa

        self.par = par
        self.spec = model_spec(hf_config, dtype)
        self.config = transformer_config(hf_config, self.spec, par)
        self.padded_vocab = default_padded_vocab(self.spec.vocab_size, par.tp)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        if torch.cuda.is_available():  # megatron-core draws TP-sharded initial weights from its CUDA RNG tracker
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

            if not get_cuda_rng_tracker().get_states():
                model_parallel_cuda_manual_seed(1234)
        layer_spec = with_sdpa(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=self.spec.qk_norm))
        self.chunks: List[torch.nn.Module] = []
        for v in range(par.chunks):
            vp = v if par.vpp else None
            model = GPTModel(
                config=self.config, transformer_layer_spec=layer_spec, vocab_size=self.padded_vocab,
                max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                share_embeddings_and_output_weights=self.spec.tie_word_embeddings,
                position_embedding_type="rope", rotary_base=int(rope_theta(hf_config)),
                vp_stage=vp)
            # without Apex the local spec's norms are torch norms made in the default dtype, whatever
            # params_dtype says: every parameter in the layout's dtype (buffers such as the rotary
            # frequencies keep theirs)
            for param in model.parameters():
                if param.is_floating_point() and param.dtype != self.spec.dtype:
                    param.data = param.data.to(self.spec.dtype)
            if torch.cuda.is_available():
                model.cuda(torch.cuda.current_device())
            self.chunks.append(model)

    # ---- layouts

    def _chunk_tensors(self, t: int, p: int, v: int, rank: int) -> List[PhysTensor]:
        par = self.par
        prefix = f"{v}." if par.vpp else ""
        return megatron_stage_tensors(self.spec, par.tp, par.pp * par.chunks, t, v * par.pp + p, rank, self.spec.dtype,
                                      self.padded_vocab, prefix=prefix)

    def local_layout(self) -> Layout:
        """This rank's parameters as a one-process layout (names ``[v.]<megatron name>``)."""
        tensors = [x for v in range(self.par.chunks) for x in self._chunk_tensors(self.tp_rank, self.pp_rank, v, 0)]
        return Layout(logical_shapes(self.spec), tensors, 1, kind="megatron-local")

    def parallel_layout(self, rank_of: Mapping[tuple, int], world: int) -> Layout:
        """Every shard of the model over the model-parallel group (``rank_of[(t, p)]``: group rank)."""
        tensors = [x for (t, p), r in sorted(rank_of.items()) for v in range(self.par.chunks)
                   for x in self._chunk_tensors(t, p, v, r)]
        aliases = ("output_layer.weight",) if self.spec.tie_word_embeddings else ()
        return Layout(logical_shapes(self.spec), tensors, world, kind=f"megatron[tp={self.par.tp},pp={self.par.pp}]",
                      aliases=aliases)

    def named_parameters(self) -> Dict[str, torch.Tensor]:
        """This rank's parameters under the layout's names (through DDP wrappers: ``.module``)."""
        out: Dict[str, torch.Tensor] = {}
        for v, chunk in enumerate(self.chunks):
            prefix = f"{v}." if self.par.vpp else ""
            for name, param in chunk.named_parameters():
                out[prefix + name.removeprefix("module.")] = param
        return out

    # ---- weights in and out

    def load_hf(self, state: Mapping[str, torch.Tensor]) -> None:
        """Writes this rank's shards from HF tensors (a state dict, or any mapping that reads lazily:
        only the tensors this rank's shards use are read)."""
        dst = self.local_layout()
        params = self.named_parameters()
        expected = {t.name for t in dst.tensors}
        if set(params) != expected:
            raise ValueError(f"the Megatron model and its layout disagree: only in the model "
                             f"{sorted(set(params) - expected)[:5]}, only in the layout {sorted(expected - set(params))[:5]}")
        needed = sorted({p.logical for t in dst.tensors for p in t.pieces if p.logical is not None})
        missing = [n for n in needed if n not in state]
        if missing:
            raise ValueError(f"the HF weights lack {missing[:5]} (needed by this rank's shards)")
        sources = {n: state[n] for n in needed}
        src = Layout(logical_shapes(self.spec), [replicated(n, n, tuple(sources[n].shape), 0, sources[n].dtype)
                                                 for n in needed], 1, kind="hf-needed")
        with torch.no_grad():
            reshard(sources, src, dst, {n: p.data for n, p in params.items()})

    def to_hf(self, destinations: Optional[Mapping[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """The whole model under HF names on every rank of the model-parallel group (collective over it);
        written into ``destinations`` (e.g. an HF model's parameters) when given."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        world = dist.get_world_size(group)
        coords: List = [None] * world
        dist.all_gather_object(coords, (self.tp_rank, self.pp_rank), group=group)
        src = self.parallel_layout({tuple(c): r for r, c in enumerate(coords)}, world)
        dst = hf_layout(self.spec, ranks=range(world), world_size=world)
        sources = {n: p.detach() for n, p in self.named_parameters().items()}
        with torch.no_grad():
            return reshard(sources, src, dst, destinations, group=group if world > 1 else None)
