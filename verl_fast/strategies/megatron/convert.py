"""``verl-fast convert``: a Megatron checkpoint to a Hugging Face folder (safetensors + config.json)
that transformers and vLLM load directly. Written to a temporary folder, then renamed (see
``verl_fast.files.output_folder``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch

from verl_fast.files import output_folder
from verl_fast.ops.reshard.spec import ModelSpec
from verl_fast.strategies.megatron.checkpoint_loader import load_megatron_checkpoint, megatron_args, spec_from_megatron_args

DEFAULT_SHARD_BYTES = 5 << 30
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}


def hf_config_from_spec(spec: ModelSpec, args=None):
    """A transformers config for ``spec``, with norm epsilon, RoPE base, context length and top-k
    from Megatron-LM's ``args`` when they are known."""
    import transformers

    kw = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
              num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
              num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
              tie_word_embeddings=spec.tie_word_embeddings)
    if spec.family == "llama":
        kw.update(attention_bias=spec.qkv_bias, mlp_bias=spec.mlp_bias)
    if spec.family in ("qwen3", "qwen3_moe"):
        kw.update(attention_bias=spec.qkv_bias)
    if spec.family in ("qwen2_moe", "qwen3_moe"):
        kw.update(num_experts=spec.num_experts, moe_intermediate_size=spec.moe_intermediate_size,
                  mlp_only_layers=[i for i, s in enumerate(spec.sparse_layers) if not s])
    if spec.family == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    if spec.family == "mixtral":
        kw.update(num_local_experts=spec.num_experts, intermediate_size=spec.moe_intermediate_size)
    g = (lambda k: getattr(args, k, None)) if args is not None else (lambda k: None)
    for hf_key, mg_key in (("rms_norm_eps", "norm_epsilon"), ("max_position_embeddings", "max_position_embeddings"),
                           ("num_experts_per_tok", "moe_router_topk")):
        if g(mg_key) is not None:
            kw[hf_key] = g(mg_key)
    if g("rotary_base") is not None:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(g("rotary_base"))}
    config = transformers.AutoConfig.for_model(spec.family, **kw)
    config.architectures = [_ARCHITECTURES[spec.family]]
    return config


def _load_config(config):
    if config is None or not isinstance(config, (str, os.PathLike)):
        return config
    import transformers

    return transformers.AutoConfig.from_pretrained(os.fspath(config))


def save_safetensors(state: Dict[str, torch.Tensor], folder: str, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """``model.safetensors``, or numbered shards and ``model.safetensors.index.json`` past the limit."""
    from safetensors.torch import save_file

    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += n
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def convert_megatron_to_hf(checkpoint_path: str, output_dir: str, tp_size: Optional[int] = None,
                           pp_size: Optional[int] = None, config: Union[str, object, None] = None,
                           dtype: Optional[torch.dtype] = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                           overwrite: bool = False) -> str:
    """Writes ``output_dir`` (config.json + safetensors with HF checkpoint names) under a temporary
    name, then renames it (``verl_fast.files.output_folder``: not inside the checkpoint; a folder holding
    files only with ``overwrite``, which replaces just the files written)."""
    out, source = Path(output_dir), Path(checkpoint_path)
    output_folder.check_target(out, source, overwrite, "the conversion")  # before any work
    config = _load_config(config)
    args = megatron_args(checkpoint_path) if config is None else None
    state = load_megatron_checkpoint(checkpoint_path, tp_size, pp_size, config=config, dtype=dtype,
                                     names="checkpoint")
    if config is None:
        config = hf_config_from_spec(spec_from_megatron_args(args), args)
    config.dtype = next(iter(state.values())).dtype

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        save_safetensors(state, str(tmp), max_shard_bytes)

    output_folder.write_folder(out, source, fill, overwrite=overwrite, what="the conversion",
                               stale=lambda name: name.startswith("model") and (name.endswith(".safetensors")
                                                                                or name.endswith(".index.json")))
    return os.fspath(output_dir)
