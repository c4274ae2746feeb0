"""Checkpoints written by megatron-core itself (GPTModel, local spec, gloo on CPU) at TP=2 and PP=2,
in both formats, load into an HF model whose logits equal the Megatron model's."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # dist_checkpointing.save hangs without it

import torch.multiprocessing as mp  # noqa: E402
import transformers  # noqa: E402

from verl_fast import load_megatron_checkpoint  # noqa: E402

import megatron_worker as W  # noqa: E402
from reshard_refs import assert_same  # noqa: E402
from ports import free_port  # noqa: E402

pytestmark = pytest.mark.slow


def hf_config(moe):
    common = dict(vocab_size=250, hidden_size=W.HIDDEN, num_hidden_layers=W.LAYERS, num_attention_heads=W.HEADS,
                  num_key_value_heads=W.GROUPS, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=64)
    if moe:
        return transformers.Qwen2MoeConfig(intermediate_size=W.FFN, moe_intermediate_size=32, num_experts=4,
                                           num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                           norm_topk_prob=False, **common)
    return transformers.Qwen2Config(intermediate_size=W.FFN, **common)


@pytest.mark.parametrize("tp,pp,moe", [(1, 2, False), (2, 2, True)])  # world 2 and 4
def test_megatron_core_checkpoint_logits(tmp_path, tp, pp, moe):
    mp.spawn(W.worker, args=(tp * pp, free_port(), tp, pp, moe, str(tmp_path)), nprocs=tp * pp, join=True)
    cfg = hf_config(moe)
    legacy = load_megatron_checkpoint(tmp_path / "legacy", tp, pp, config=cfg)
    dist_ckpt = load_megatron_checkpoint(tmp_path / "torch_dist", config=cfg)
    assert_same(dict(dist_ckpt), dict(legacy))
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    missing, unexpected = model.load_state_dict(legacy, strict=True)
    ref = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"][..., :250], atol=1e-4, rtol=1e-4)
