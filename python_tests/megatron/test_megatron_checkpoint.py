"""Megatron checkpoints (legacy ``mp_rank_*`` layout, written here from a plain reference split of an
HF model) loaded back into HF names bit-exactly, every family at TP 1/2 x PP 1/2; Megatron shards
resharded straight into vLLM's layout; bad checkpoints named."""

import argparse
import os
import random

import numpy as np
import pytest
import torch

from verl_fast import load_megatron_checkpoint
from verl_fast.strategies.megatron.checkpoint_loader import megatron_args
from verl_fast.ops.reshard import ModelSpec, plan, vllm_layout
from verl_fast.ops.reshard.megatron import megatron_layout, shard_prefix

from reshard_refs import assert_same, ref_megatron, ref_vllm
from tiny_models import FAMILIES, tiny_model


def write_legacy(root, shards, pp, args=None, iteration=7, **extra):
    it = os.path.join(root, f"iter_{iteration:07d}")
    for (t, p), state in shards.items():
        d = os.path.join(it, shard_prefix(t, p, pp))
        os.makedirs(d, exist_ok=True)
        torch.save({"model": state, "args": args, "checkpoint_version": 3.0, "iteration": iteration, **extra},
                   os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_legacy_checkpoint_roundtrip(tmp_path, family, tp, pp):
    extra = {"vocab_size": 300} if family == "qwen2" else {}
    model = tiny_model(family, **extra)
    sd, cfg = model.state_dict(), model.config
    padded = 256 * tp * (-(-cfg.vocab_size // (256 * tp)))
    shards = ref_megatron(sd, cfg, tp, pp, padded)
    for s in shards.values():  # Megatron's extra state entries are skipped
        s["decoder.layers.0.self_attention.linear_proj._extra_state"] = None
    root = write_legacy(str(tmp_path), shards, pp)
    got = load_megatron_checkpoint(root, tp, pp, config=cfg)
    assert_same(dict(got), sd)  # the tied head too: the model's own state-dict keys


@pytest.mark.parametrize("family,tp,pp,vtp", [("qwen2", 2, 2, 2), ("qwen3_moe", 2, 1, 1), ("mixtral", 1, 2, 2),
                                              ("llama", 2, 2, 4)])
def test_megatron_shards_to_vllm(family, tp, pp, vtp):
    """Megatron TP/PP shards (all in this process) straight into vLLM's TP shards."""
    model = tiny_model(family)
    sd, cfg = model.state_dict(), model.config
    spec = ModelSpec.from_hf_config(cfg)
    padded = 128 * tp * 3
    shards = ref_megatron(sd, cfg, tp, pp, padded)
    sources = {shard_prefix(t, p, pp) + k: v for (t, p), s in shards.items() for k, v in s.items()}
    src = megatron_layout(spec, tp, pp, padded_vocab_size=padded, in_one_process=True)
    for t in range(vtp):
        out = plan(src, vllm_layout(spec, vtp, {0: t})).execute(sources)
        assert_same(dict(out), ref_vllm(sd, cfg, vtp, t))


def test_te_norm_names_and_megatron_args(tmp_path):
    """Transformer Engine's fused norm names; the architecture from Megatron-LM's pickled args, which
    hold megatron-core enums and torch dtypes (the enums load as inert stand-ins; no megatron-core
    class is imported or called), and numpy RNG states beside them."""
    enums = pytest.importorskip("megatron.core.transformer.enums")
    model = tiny_model("qwen2")
    sd, cfg = model.state_dict(), model.config
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                              num_query_groups=2, kv_channels=16, ffn_hidden_size=96, add_qkv_bias=True,
                              vocab_size=cfg.vocab_size, untie_embeddings_and_output_weights=True,
                              attention_backend=enums.AttnBackend.auto, params_dtype=torch.bfloat16)
    shards = ref_megatron(sd, cfg, 2, 1, 512, te_norms=True)
    root = write_legacy(str(tmp_path), shards, 1, args=args,
                        rng_state=[{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                    "torch_rng_state": torch.get_rng_state()}])
    got = load_megatron_checkpoint(root)  # tp/pp from the directories, architecture from args
    assert_same(dict(got), dict(sd))
    loaded = megatron_args(root)
    assert type(loaded.attention_backend).__name__ == "AttnBackend"
    assert loaded.attention_backend.value == enums.AttnBackend.auto.value and loaded.params_dtype == torch.bfloat16


def test_bad_checkpoints_are_named(tmp_path):
    model = tiny_model("llama")
    sd, cfg = model.state_dict(), model.config
    shards = ref_megatron(sd, cfg, 2, 2, 512)
    root = write_legacy(str(tmp_path / "a"), {k: v for k, v in shards.items() if k != (1, 1)}, 2)
    with pytest.raises(ValueError, match="missing shard mp_rank_01_001"):
        load_megatron_checkpoint(root, 2, 2, config=cfg)
    shards[(0, 0)]["decoder.layers.0.self_attention.rotary.weight"] = torch.zeros(2)
    root = write_legacy(str(tmp_path / "b"), shards, 2)
    with pytest.raises(ValueError, match="decoder.layers.0.self_attention.rotary.weight"):
        load_megatron_checkpoint(root, 2, 2, config=cfg)
    del shards[(0, 0)]["decoder.layers.0.self_attention.rotary.weight"]
    shards[(1, 1)]["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(64, 47)
    root = write_legacy(str(tmp_path / "c"), shards, 2)
    with pytest.raises(ValueError, match=r"mp_rank_01_001/decoder.layers.0.mlp.linear_fc2.weight.*\[64, 48\]"):
        load_megatron_checkpoint(root, 2, 2, config=cfg)
    with pytest.raises(ValueError, match="no mp_rank"):
        load_megatron_checkpoint(str(tmp_path))


@pytest.mark.parametrize("family,with_config", [("qwen2_moe", True), ("qwen2", False)])
def test_convert_cli_writes_a_loadable_hf_folder(tmp_path, family, with_config):
    import transformers

    from verl_fast.cli.main import main

    model = tiny_model(family)
    sd, cfg = model.state_dict(), model.config
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                              num_query_groups=2, kv_channels=16, ffn_hidden_size=96, add_qkv_bias=True,
                              vocab_size=cfg.vocab_size, untie_embeddings_and_output_weights=True, norm_epsilon=1e-6,
                              rotary_base=10000, max_position_embeddings=256)
    root = write_legacy(str(tmp_path / "ckpt"), ref_megatron(sd, cfg, 2, 2, 512), 2, args=args)
    argv = ["convert", root, str(tmp_path / "hf"), "--tp", "2", "--pp", "2", "--max-shard-gb", "0.0001"]
    if with_config:
        cfg.save_pretrained(tmp_path / "cfg")
        argv += ["--config", str(tmp_path / "cfg")]
    assert main(argv) == 0
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")  # sharded at 100 kB
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded) is type(model)
    assert_same(dict(loaded.state_dict()), dict(sd))
    tokens = torch.randint(0, cfg.vocab_size, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, atol=0, rtol=0)
