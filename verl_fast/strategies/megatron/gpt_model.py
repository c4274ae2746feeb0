"""A megatron-core ``GPTModel`` built from a Hugging Face config, and its weights moved to and from
Hugging Face names through the resharding layouts (``ops/reshard/megatron.py``).

The model uses megatron-core's local layer spec (no Transformer Engine): RMSNorm, SwiGLU MLP,
grouped-query attention with rotary embeddings; Qwen2's QKV bias and Qwen3's per-head q/k norms;
Qwen2-MoE / Qwen3-MoE sparse blocks (top-k router, renormalised or not as ``norm_topk_prob`` says,
no auxiliary loss, Qwen2-MoE's gated shared expert; experts as a SequentialMLP, the all-gather token
dispatcher) with ``ep`` expert-parallel ranks each holding ``num_experts / ep`` consecutive experts.
Its core attention is ``attention.SDPAttention`` (torch's fused attention kernels).
With a virtual pipeline (``vpp`` chunks per stage) chunk ``v`` of stage ``p`` is virtual stage
``v * pp + p`` of ``pp * vpp`` equal stages, megatron-core's interleaved order.

Weights: each rank plans, in its own process, the copy from the HF tensors its shards need into
its parameters (it reads nothing else). The way back (rollout weights, HF export) is one
distributed plan over the model-parallel group (with experts spread, the expert-model-pipeline
group, which holds every expert): every rank of it ends with the whole HF model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from verl_fast.ops.reshard.api import reshard
from verl_fast.ops.reshard.hf import hf_layout
from verl_fast.ops.reshard.layout import Layout, PhysTensor, replicated
from verl_fast.ops.reshard.megatron import default_padded_vocab, megatron_stage_tensors
from verl_fast.ops.reshard.spec import ModelSpec, logical_shapes

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
VALUE_HEAD = ("score.weight", "score.bias")  # the critic's head under HF names ([1, H], [1])


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


def model_spec(hf_config, dtype: torch.dtype, role: str = "actor", par: Parallel = Parallel()) -> ModelSpec:
    spec = ModelSpec.from_hf_config(hf_config, dtype=dtype)
    if spec.family not in DENSE_FAMILIES + MOE_FAMILIES:
        raise ValueError(f"{role}.strategy=megatron supports model_type {DENSE_FAMILIES + MOE_FAMILIES}, got "
                         f"{spec.family!r}")
    if par.ep > 1 and not spec.is_moe:
        raise ValueError(f"actor.expert_model_parallel_size={par.ep} needs a mixture-of-experts model "
                         f"({MOE_FAMILIES}), got {spec.family!r}; set it to 1")
    if spec.is_moe and not all(spec.sparse_layers):
        raise ValueError(f"{role}.strategy=megatron: dense layers among the MoE layers (mlp_only_layers / "
                         "decoder_sparse_step in the HF config) are not supported; use strategy fsdp2")
    if par.ep > 1 and par.tp > 1:
        raise ValueError("actor.expert_model_parallel_size > 1 is not supported with tensor_model_parallel_size > 1 "
                         "(megatron-core needs sequence parallelism there); use one of them")
    if spec.o_bias or spec.mlp_bias:
        raise ValueError(f"{role}.strategy=megatron: attention output / MLP biases (attention_bias or mlp_bias in "
                         "the HF config) are not supported by the local layer spec mapping; use strategy fsdp2")
    rope_theta(hf_config, role)  # raises on scaled rotary embeddings
    return spec


def rope_theta(hf_config, role: str = "actor") -> float:
    """The rotary base; scaled variants (YaRN, Llama-3's) are refused: the local spec has none of them."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{role}.strategy=megatron: rotary scaling {kind!r} is not supported; use strategy fsdp2")
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
        use_cpu_initialization=not torch.cuda.is_available(), **moe_config(hf_config, spec))


def moe_config(hf_config, spec: ModelSpec) -> Dict:
    """TransformerConfig's MoE fields for a Qwen MoE config (none for a dense model). HF's router: softmax
    over every expert, the top k, renormalised when ``norm_topk_prob``; megatron-core's pre-softmax
    router is the unnormalised form, its default (softmax over the top k logits) the renormalised one."""
    if not spec.is_moe:
        return {}
    shared = spec.shared_expert_intermediate_size if spec.has_shared_expert else 0
    # the all-gather dispatcher: the all-to-all one needs CUDA streams; no auxiliary loss (HF adds none
    # unless output_router_logits is set)
    return dict(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_intermediate_size,
                moe_router_topk=int(hf_config.num_experts_per_tok),
                moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", False)),
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False, moe_shared_expert_intermediate_size=shared or None,
                moe_shared_expert_gate=bool(shared))


def _router_without_te() -> None:
    """megatron-core 0.16's router GEMM tests ``te_general_gemm is not None``, a name its module defines
    only when Transformer Engine imports (a NameError without it): define it as absent, so that the
    router takes its plain torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class ValueHead(torch.nn.Module):
    """A critic's output layer: one value per position from the final (normed) hidden states, in place
    of the vocabulary projection (called as GPTModel calls its output layer). Replicated on every TP
    rank: each gets the same hidden states, so the same gradient."""

    def __init__(self, hidden: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias else None

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None  # [S, n, 1]


class MegatronGPT:
    """The model chunks of this rank and what moves weights in and out of them. ``value_head``: a
    critic, whose last stage ends in a ``ValueHead`` (HF names ``score.weight`` / ``score.bias``, the
    bias only with ``value_bias``) instead of the vocabulary projection."""

    def __init__(self, hf_config, par: Parallel, dtype: torch.dtype = torch.float32, value_head: bool = False,
                 value_bias: bool = True):
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from verl_fast.strategies.megatron.attention import with_sdpa

        self.par = par
        self.spec = model_spec(hf_config, dtype, "critic" if value_head else "actor", par)
        self.value_head = value_head
        self.logical = logical_shapes(self.spec)
        if value_head:  # the body's tensors, then the head's; no vocabulary projection
            self.logical.pop("lm_head.weight", None)
            self.logical[VALUE_HEAD[0]] = (1, self.spec.hidden_size)
            if value_bias:
                self.logical[VALUE_HEAD[1]] = (1,)
        self.config = transformer_config(hf_config, self.spec, par)
        self.padded_vocab = default_padded_vocab(self.spec.vocab_size, par.tp)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        if torch.cuda.is_available():  # megatron-core draws TP-sharded initial weights from its CUDA RNG tracker
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

            if not get_cuda_rng_tracker().get_states():
                model_parallel_cuda_manual_seed(1234)
        if self.spec.is_moe:
            _router_without_te()
        layer_spec = with_sdpa(get_gpt_layer_local_spec(num_experts=self.spec.num_experts or None,
                                                        moe_grouped_gemm=False, normalization="RMSNorm",
                                                        qk_layernorm=self.spec.qk_norm))
        self.chunks: List[torch.nn.Module] = []
        for v in range(par.chunks):
            vp = v if par.vpp else None
            model = GPTModel(
                config=self.config, transformer_layer_spec=layer_spec, vocab_size=self.padded_vocab,
                max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                share_embeddings_and_output_weights=self.spec.tie_word_embeddings and not value_head,
                position_embedding_type="rope", rotary_base=int(rope_theta(hf_config)),
                vp_stage=vp)
            if value_head and model.post_process:
                model.output_layer = ValueHead(self.spec.hidden_size, value_bias, self.spec.dtype)
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

    def _chunk_tensors(self, t: int, p: int, e: int, v: int, rank: int) -> List[PhysTensor]:
        par = self.par
        prefix = f"{v}." if par.vpp else ""
        stage, stages = v * par.pp + p, par.pp * par.chunks
        out = megatron_stage_tensors(self.spec, par.tp, stages, t, stage, rank, self.spec.dtype, self.padded_vocab,
                                     prefix=prefix, ep=par.ep, ep_rank=e)
        if self.value_head:
            out = [x for x in out if x.name != prefix + "output_layer.weight"]
            if stage == stages - 1:
                out += [replicated(f"{prefix}output_layer.{n.split('.')[-1]}", n, self.logical[n], rank, self.spec.dtype)
                        for n in VALUE_HEAD if n in self.logical]
        return out

    def local_layout(self) -> Layout:
        """This rank's parameters as a one-process layout (names ``[v.]<megatron name>``)."""
        tensors = [x for v in range(self.par.chunks)
                   for x in self._chunk_tensors(self.tp_rank, self.pp_rank, self.ep_rank, v, 0)]
        return Layout(self.logical, tensors, 1, kind="megatron-local")

    def parallel_layout(self, coords: Sequence[Tuple[int, int, int]]) -> Layout:
        """Every rank's shards over a group: ``coords[r]`` is the ``(tp rank, pp rank, ep rank)`` of group
        rank r (data-parallel replicas of a shard may appear several times)."""
        tensors = [x for r, (t, p, e) in enumerate(coords) for v in range(self.par.chunks)
                   for x in self._chunk_tensors(t, p, e, v, r)]
        aliases = ("output_layer.weight",) if self.spec.tie_word_embeddings and not self.value_head else ()
        return Layout(self.logical, tensors, len(coords), kind=f"megatron[tp={self.par.tp},pp={self.par.pp}]",
                      aliases=aliases)

    def group_layout(self, group=None) -> Layout:
        """``parallel_layout`` of ``group`` (default: the world); collective over it."""
        coords: List = [None] * dist.get_world_size(group)
        dist.all_gather_object(coords, (self.tp_rank, self.pp_rank, self.ep_rank), group=group)
        return self.parallel_layout([tuple(c) for c in coords])

    def weights_group(self):
        """The smallest group holding every weight: the model-parallel group, or with experts spread
        the expert-tensor-model-pipeline group (its dense shards repeat over the expert ranks)."""
        from megatron.core import parallel_state as ps

        return ps.get_expert_tensor_model_pipeline_parallel_group() if self.par.ep > 1 else \
            ps.get_model_parallel_group()

    def hf_layout(self, ranks: Sequence[int], world: int) -> Layout:
        """The whole model under HF names on each of ``ranks`` (of ``world``)."""
        if not self.value_head:
            return hf_layout(self.spec, ranks=ranks, world_size=world)
        tensors = [replicated(n, n, shape, r, self.spec.dtype) for r in ranks for n, shape in self.logical.items()]
        return Layout(self.logical, tensors, world, kind="hf-critic")

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
        device = next(iter(params.values())).device  # an HF model on the host loads into shards on the GPU
        sources = {n: state[n].to(device) for n in needed}
        src = Layout(self.logical, [replicated(n, n, tuple(sources[n].shape), 0, sources[n].dtype)
                                                 for n in needed], 1, kind="hf-needed")
        with torch.no_grad():
            reshard(sources, src, dst, {n: p.data for n, p in params.items()})

    def to_hf(self, destinations: Optional[Mapping[str, torch.Tensor]] = None,
              only_first: bool = False) -> Dict[str, torch.Tensor]:
        """The whole model under HF names on every rank of ``weights_group()`` (collective over it), or on
        its first rank only (``only_first``; the others get ``{}``); written into ``destinations`` (e.g. an
        HF model's parameters) when given."""
        group = self.weights_group()
        world = dist.get_world_size(group)
        src = self.group_layout(group)
        dst = self.hf_layout([0] if only_first else range(world), world)
        sources = {n: p.detach() for n, p in self.named_parameters().items()}
        with torch.no_grad():
            return reshard(sources, src, dst, destinations, group=group if world > 1 else None)
