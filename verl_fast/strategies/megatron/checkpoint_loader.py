"""Megatron checkpoints into Hugging Face state dicts, without Megatron installed.

Two formats:
- legacy: ``[iter_NNNNNNN|release]/mp_rank_TT[_PPP]/model_optim_rng.pt``, one ``torch.save`` per
  tensor/pipeline shard holding ``{"model": state_dict, "args": Namespace, ...}``;
- ``torch_dist`` (megatron-core ``dist_checkpointing``): global tensors read with
  ``torch.distributed.checkpoint.FileSystemReader``, whatever the TP/PP they were saved with.
Either way the shards are resharded by the same planner that feeds vLLM (Megatron layout -> HF
layout), bit for bit.

Checkpoint files are read as data only (``verl_fast.files.safe_load``: ``torch.load(weights_only=True)``)
with an allowlist of the globals Megatron writes besides tensors: argparse.Namespace for ``args``,
numpy arrays in the RNG states, io.BytesIO extra states, and megatron-core's enums, which load as
inert stand-ins whether or not megatron-core is installed. Anything else in the pickle is refused
with an error naming the file and the global; no code stored in a checkpoint ever runs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
from collections import OrderedDict
from typing import Dict, Mapping, Optional, Tuple, Union

import torch

from verl_fast.files import safe_load
from verl_fast.ops import arguments as V
from verl_fast.ops.reshard.hf import hf_layout
from verl_fast.ops.reshard.megatron import detect_names, megatron_layout, shard_prefix, torch_dist_layout, vocab_rows
from verl_fast.ops.reshard.plan import ReshardPlan
from verl_fast.ops.reshard.spec import ModelSpec, positive_ints

_SHARD_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


# ---- reading files -----------------------------------------------------------------------------


class MegatronEnum:
    """An inert stand-in for a megatron-core enum member found in a checkpoint (``args.model_type``,
    ``args.attention_backend``, ...): it keeps the member's value and nothing runs."""

    def __init__(self, value=None):
        self.value = value

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({self.value!r})"


# The enums megatron-core and Megatron-LM put into saved args and common state.
_MEGATRON_ENUMS = (
    "megatron.core.enums.ModelType", "megatron.core.enums.Fp8Recipe", "megatron.core.enums.Fp4Recipe",
    *(f"megatron.core.transformer.enums.{n}" for n in ("ModelType", "LayerType", "AttnType", "AttnMaskType",
                                                        "AttnBackend", "CudaGraphScope")),
    *(f"megatron.core.rerun_state_machine.{n}" for n in ("RerunMode", "RerunState", "RerunDiagnostic",
                                                          "RerunValidationStatus")),
    "megatron.core.dist_checkpointing.validation.StrictHandling",
    *(f"{m}.{n}" for m in ("megatron.model.enums", "megatron.legacy.model.enums")
      for n in ("ModelType", "LayerType", "AttnType", "AttnMaskType", "PositionEmbeddingType")),
)


def checkpoint_globals() -> list:
    """What besides tensors and plain containers a Megatron checkpoint may hold, as torch.load's
    allowlist: (callable, the name the pickle uses) pairs where the two differ."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core to numpy._core
    reconstruct = core.multiarray._reconstruct
    dtypes = [getattr(np.dtypes, n) for n in dir(getattr(np, "dtypes", object)) if n.endswith("DType")]
    enums = [(type(q.rsplit(".", 1)[1], (MegatronEnum,), {"__module__": q.rsplit(".", 1)[0]}), q)
             for q in _MEGATRON_ENUMS]
    return [argparse.Namespace, io.BytesIO, np.ndarray, np.dtype, *dtypes,
            (reconstruct, "numpy.core.multiarray._reconstruct"), (reconstruct, "numpy._core.multiarray._reconstruct"),
            *enums]


def _load_dict(path: str) -> dict:
    ckpt = safe_load.load(path, checkpoint_globals(), "a Megatron checkpoint")
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path}: expected a dict (model, args, ...), got {type(ckpt).__name__}")
    return ckpt


def resolve_iteration_dir(path: str) -> str:
    """The directory holding the shards: ``path`` itself, or the iteration named by
    ``latest_checkpointed_iteration.txt`` in it."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint_path {path!r} is not a directory")
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.exists(tracker):
        it = open(tracker).read().strip()
        sub = "release" if it == "release" else f"iter_{int(it):07d}"
        path = os.path.join(path, sub)
        if not os.path.isdir(path):
            raise ValueError(f"{tracker} names iteration {it!r} but {path} does not exist")
    return path


def is_torch_dist(path: str) -> bool:
    meta = os.path.join(path, "metadata.json")
    if os.path.exists(meta):
        return json.load(open(meta)).get("sharded_backend") == "torch_dist"
    return os.path.exists(os.path.join(path, ".metadata"))


def _legacy_shards(path: str, tp: Optional[int], pp: Optional[int]) -> Tuple[int, int, Dict[Tuple[int, int], str]]:
    found: Dict[Tuple[int, int], str] = {}
    for entry in os.listdir(path):
        m = _SHARD_DIR.match(entry)
        if m:
            found[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(path, entry, "model_optim_rng.pt")
    if not found:
        raise ValueError(f"no mp_rank_* shard directories (and no torch_dist metadata) in {path}")
    tp = tp or max(t for t, _ in found) + 1
    pp = pp or max(p for _, p in found) + 1
    for t in range(tp):
        for p in range(pp):
            f = found.get((t, p))
            if f is None or not os.path.exists(f):
                raise ValueError(f"missing shard {shard_prefix(t, p, pp).rstrip('/')}/model_optim_rng.pt in {path} "
                                 f"(tp_size={tp}, pp_size={pp})")
    extra = [k for k in found if k[0] >= tp or k[1] >= pp]
    if extra:
        raise ValueError(f"{path} has shard {shard_prefix(*extra[0], 2).rstrip('/')} beyond tp_size={tp}, pp_size={pp}")
    return tp, pp, found


# ---- the model's shape -------------------------------------------------------------------------


def spec_from_megatron_args(args, vocab_size: Optional[int] = None, where: str = "Megatron args") -> ModelSpec:
    """A ModelSpec from Megatron-LM's training ``args``; the family is inferred (qk layernorm:
    Qwen3 / Qwen3-MoE; QKV bias: Qwen2; shared expert: Qwen2-MoE; experts: Mixtral; else Llama).
    Pass an HF config instead when the family matters beyond that. ``where`` names the args in errors."""
    positive_ints(args, ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"),
                  ("kv_channels", "num_query_groups"), where)
    g = lambda k, d=None: getattr(args, k, d)  # noqa: E731
    heads = g("num_attention_heads")
    experts = g("num_experts") or 0
    qk, qkv_bias, shared = bool(g("qk_layernorm")), bool(g("add_qkv_bias") or g("add_bias_linear")), g(
        "moe_shared_expert_intermediate_size") or 0
    if experts:
        family = "qwen2_moe" if shared else "qwen3_moe" if qk else "mixtral"
    else:
        family = "qwen3" if qk else "qwen2" if qkv_bias else "llama"
    layers = g("num_layers")
    return ModelSpec(
        family=family, hidden_size=g("hidden_size"), num_layers=layers, num_heads=heads,
        num_kv_heads=g("num_query_groups") if g("group_query_attention") else heads,
        head_dim=g("kv_channels") or g("hidden_size") // heads, intermediate_size=g("ffn_hidden_size"),
        vocab_size=vocab_size or g("vocab_size") or g("padded_vocab_size"),
        tie_word_embeddings=not g("untie_embeddings_and_output_weights", False), qkv_bias=qkv_bias and family != "llama",
        qk_norm=qk, num_experts=experts, moe_intermediate_size=g("moe_ffn_hidden_size") or 0,
        shared_expert_intermediate_size=shared, sparse_layers=(True,) * layers if experts else ())


def _spec(config, args, path: str) -> ModelSpec:
    if isinstance(config, ModelSpec):
        return config
    if config is not None:
        return ModelSpec.from_hf_config(config)
    if args is None:
        raise ValueError(f"{path}: the checkpoint carries no Megatron args: pass config= (an HF config or a ModelSpec)")
    return spec_from_megatron_args(args, where=f"{path}: Megatron args")


# ---- loading -----------------------------------------------------------------------------------


def _with_dtypes(layout, tensors: Mapping[str, torch.Tensor]):
    for t in layout.tensors:
        if t.name in tensors:
            t.dtype = tensors[t.name].dtype
    return layout


def _to_hf(src_layout, sources: Mapping[str, torch.Tensor], spec: ModelSpec, dtype, names: str):
    dtype = dtype or next(iter(sources.values())).dtype
    plan = ReshardPlan(src_layout, hf_layout(spec, names=names, dtype=dtype))
    out = plan.execute(sources, device="cpu")
    if names == "module" and spec.tie_word_embeddings:
        # a module's state dict lists the tied head as a key of its own (the same tensor), so that
        # model.load_state_dict(...) loads strictly; HF checkpoint files (names="checkpoint") omit it
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _load_legacy(path: str, tp, pp, config, dtype, names: str) -> "OrderedDict[str, torch.Tensor]":
    tp, pp, files = _legacy_shards(path, tp, pp)
    sources: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    args, first = None, None
    for (t, p), f in sorted(files.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ckpt = _load_dict(f)
        if "model" not in ckpt:
            keys = [k for k in ckpt if k.startswith("model")]
            raise ValueError(f"{f}: no 'model' entry (found {keys}; virtual pipeline checkpoints are not supported)")
        if not isinstance(ckpt["model"], dict):
            raise ValueError(f"{f}: 'model' must be a state dict, got {type(ckpt['model']).__name__}")
        args = args if args is not None else ckpt.get("args")
        state = {k: v for k, v in ckpt["model"].items() if not k.endswith("_extra_state")}
        first = first if first is not None else state
        prefix = shard_prefix(t, p, pp)
        sources.update((prefix + k, v.contiguous()) for k, v in state.items() if isinstance(v, torch.Tensor))
    spec = _spec(config, args, files[min(files)])
    layout = megatron_layout(spec, tp, pp, padded_vocab_size=vocab_rows(first, tp), names=detect_names(first),
                             in_one_process=True)
    return _to_hf(_with_dtypes(layout, sources), sources, spec, dtype, names)


def _load_torch_dist(path: str, config, dtype, names: str) -> "OrderedDict[str, torch.Tensor]":
    import torch.distributed.checkpoint as dcp

    reader = safe_load.dcp_reader(path)
    meta = reader.read_metadata().state_dict_metadata
    tensors = {k: v for k, v in meta.items() if hasattr(v, "size") and hasattr(v, "properties")}
    args = None
    common = os.path.join(path, "common.pt")
    if config is None and os.path.exists(common):
        args = _load_dict(common).get("args")
    spec = _spec(config, args, common if os.path.exists(common) else path)
    if "embedding.word_embeddings.weight" not in tensors:
        raise ValueError(f"{path}: no embedding.word_embeddings.weight in the torch_dist metadata")
    padded = int(tensors["embedding.word_embeddings.weight"].size[0])
    layout = torch_dist_layout(spec, padded, keys=list(tensors))
    state: Dict[str, torch.Tensor] = {}
    for t in layout.tensors:
        if t.name not in tensors:
            raise ValueError(f"{path}: missing tensor {t.name} (expected shape {list(t.shape)})")
        got = tuple(tensors[t.name].size)
        if got != tuple(t.shape):
            raise ValueError(f"{path}: tensor {t.name} has shape {list(got)}, expected {list(t.shape)} for this config")
        t.dtype = tensors[t.name].properties.dtype
        state[t.name] = torch.empty(got, dtype=t.dtype)
    dcp.load(state, storage_reader=reader, planner=safe_load.dcp_planner(), no_dist=True)
    return _to_hf(layout, state, spec, dtype, names)


def megatron_args(checkpoint_path: str):
    """Megatron-LM's saved training ``args`` (an argparse Namespace), or None if the checkpoint has none."""
    path = resolve_iteration_dir(os.fspath(checkpoint_path))
    if is_torch_dist(path):
        common = os.path.join(path, "common.pt")
        return _load_dict(common).get("args") if os.path.exists(common) else None
    _, _, files = _legacy_shards(path, None, None)
    return _load_dict(files[min(files)]).get("args")


def load_megatron_checkpoint(checkpoint_path: str, tp_size: Optional[int] = None, pp_size: Optional[int] = None,
                             config: Union[ModelSpec, object, None] = None, dtype: Optional[torch.dtype] = None,
                             names: str = "module") -> "OrderedDict[str, torch.Tensor]":
    """A Megatron-core GPT checkpoint (legacy ``mp_rank_*`` shards or ``torch_dist``) as an HF state dict.

    ``tp_size`` / ``pp_size`` are checked against the legacy shard directories (inferred when
    omitted; ``torch_dist`` holds global tensors, so they are not needed). ``config`` (an HF config
    or a ModelSpec) gives the architecture; without it Megatron-LM's saved ``args`` are used.
    ``names="module"`` gives the model's own state-dict keys (a tied ``lm_head.weight`` included, the
    embedding's tensor), so ``model.load_state_dict(load_megatron_checkpoint(...))`` loads strictly;
    ``names="checkpoint"`` gives MoE experts one tensor each and no tied head, as HF checkpoint files name them.
    The files are loaded as data only: ``torch.load(weights_only=True)`` with an allowlist
    (argparse.Namespace, numpy RNG arrays, io.BytesIO, megatron-core's enums as inert stand-ins);
    a pickle holding anything else (code to run) is refused with a ValueError naming the file.
    """
    tp_size = None if tp_size is None else V.size(tp_size, "tp_size", 1)
    pp_size = None if pp_size is None else V.size(pp_size, "pp_size", 1)
    path = resolve_iteration_dir(os.fspath(checkpoint_path))
    if is_torch_dist(path):
        return _load_torch_dist(path, config, dtype, names)
    return _load_legacy(path, tp_size, pp_size, config, dtype, names)
