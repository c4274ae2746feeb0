"""LoRA from the config (actor.lora) and its export: the merge against W + s * B @ A in float64, the
merged HF folder loading in transformers with no missing or unexpected keys and the PEFT actor's
outputs, and the adapter folder loading with PeftModel.from_pretrained (also after verl-fast export
of the checkpoint's shards)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast import config as C
from verl_fast.models import lora
from verl_fast.trainer.rl_trainer import RLTrainer

peft = pytest.importorskip("peft")


@settings(max_examples=40, deadline=None)
@given(out_f=st.integers(1, 9), in_f=st.integers(1, 9), r=st.integers(1, 6), alpha=st.floats(0.5, 64),
       rslora=st.booleans(), fan_in_fan_out=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 1000))
def test_merge_matches_the_formula(out_f, in_f, r, alpha, rslora, fan_in_fan_out, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((in_f, out_f) if fan_in_fan_out else (out_f, in_f), generator=g).to(dtype)
    a, b = torch.randn(r, in_f, generator=g), torch.randn(out_f, r, generator=g)
    names = {"base_model.model.layer.base_layer.weight": w, "base_model.model.layer.lora_A.default.weight": a,
             "base_model.model.layer.lora_B.default.weight": b, "base_model.model.norm.weight": torch.ones(3)}
    cfg = {"lora_alpha": alpha, "use_rslora": rslora, "fan_in_fan_out": fan_in_fan_out}
    plan = lora.export_plan(list(names), cfg)
    assert sorted(plan) == ["layer.weight", "norm.weight"]
    got = lora.exported(plan["layer.weight"], names, cfg)
    s = alpha / math.sqrt(r) if rslora else alpha / r
    delta = s * (b.double() @ a.double())
    want = w.double() + (delta.T if fan_in_fan_out else delta)
    assert got.dtype == dtype and got.shape == w.shape
    tol = 1e-5 * (1 + want.abs().max().item()) if dtype == torch.float32 else 8e-3 * (1 + want.abs().max().item())
    assert (got.double() - want).abs().max().item() <= tol
    assert lora.exported(plan["norm.weight"], names, cfg) is names["base_model.model.norm.weight"]


def test_unsupported_adapters_are_named():
    with pytest.raises(ValueError, match="DoRA"):
        lora.export_plan(["x.lora_A.default.weight"], {"lora_alpha": 8, "use_dora": True})
    with pytest.raises(ValueError, match="cannot merge 'base_model.model.emb.lora_embedding_A.default'"):
        lora.export_plan(["base_model.model.emb.lora_embedding_A.default"], {"lora_alpha": 8})
    with pytest.raises(ValueError, match="misses lora_A / lora_B"):
        lora.export_plan(["m.base_layer.weight", "m.lora_A.default.weight"], {"lora_alpha": 8})


@pytest.mark.parametrize("spec,message", [
    ({"alpha": 8}, "actor.lora needs r"),
    ({"r": 0}, "actor.lora.r must be >= 1"),
    ({"r": 8, "rank": 2}, r"unknown key actor.lora.rank; allowed keys in actor.lora: \['alpha', 'dropout', 'r'"),
    ({"r": 8, "dropout": 1.5}, "actor.lora.dropout must be <= 0.999"),
    ({"r": 8, "target_modules": "q_proj"}, "actor.lora.target_modules must be all-linear or a list"),
    ({"r": 1024}, "actor.lora.r must be <= 512"),
    ({"r": 8, "alpha": "big"}, "actor.lora.alpha must be a number, got 'big'"),
    (16, "actor.lora must be a mapping of keys, got 16"),
])
def test_lora_config_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        C.from_dict({"actor": {"lora": spec}})
    with pytest.raises(ValueError, match="actor.lora is not supported with actor.strategy=megatron"):
        C.from_dict({"actor": {"lora": {"r": 8}, "strategy": "megatron"}})


def test_lora_config_is_typed_from_yaml_dicts_and_python():
    """actor.lora's mapping becomes a LoraConfig (alpha null: 2r); a Config built in Python with a
    LoraConfig or the same mapping is checked alike."""
    cfg = C.from_dict({"actor": {"lora": {"r": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}}})
    assert cfg.actor.lora == C.LoraConfig(r=16, alpha=None, dropout=0.05, target_modules=["q_proj", "v_proj"])
    assert cfg.actor.lora.scale_alpha == 32.0 and C.LoraConfig(r=16, alpha=8).scale_alpha == 8
    assert C.from_dict({"actor": {}}).actor.lora is None
    for given in (C.LoraConfig(r=4, alpha=8), {"r": 4, "alpha": 8}):
        built = C.Config(actor=C.ActorConfig(lora=given))
        assert C.checked(built).actor.lora == C.LoraConfig(r=4, alpha=8.0)
    with pytest.raises(ValueError, match="actor.lora.dropout must be >= 0.0"):
        C.checked(C.Config(actor=C.ActorConfig(lora=C.LoraConfig(r=4, dropout=-1.0))))
    loaded = C.apply_overrides({}, ["actor.lora={r: 16, alpha: 32}", "actor.lora.dropout=0.1"])
    assert C.from_dict(loaded).actor.lora == C.LoraConfig(r=16, alpha=32.0, dropout=0.1)


def test_vllm_lora_rank_comes_from_the_config_else_the_peft_model():
    """vLLM's max_lora_rank: actor.lora.r where the config sets the adapters, the PEFT model's own
    rank where the user hands over a PEFT model (actor.lora unset)."""
    from verl_fast.rollout.factory import lora_rank

    class Adapter:
        def __init__(self, r):
            self.r = r

    class Handed:  # a PEFT model's peft_config: adapter name -> its LoraConfig
        peft_config = {"default": Adapter(40), "other": Adapter(4)}

    assert lora_rank(Handed(), None) == 64  # the smallest vLLM rank that holds 40
    assert lora_rank(Handed(), C.LoraConfig(r=16)) == 16
    assert lora_rank(Handed(), C.LoraConfig(r=9)) == 16
    with pytest.raises(ValueError, match="above vLLM's largest"):
        lora_rank(type("Big", (), {"peft_config": {"d": Adapter(600)}})(), None)


def outputs(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def test_lora_actor_from_the_config_exports_merged_and_adapter(tmp_path):
    path = save_tiny_model(tmp_path / "base", family="qwen2", seed=7)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {"actor": {"lr": 5e-2, "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}},
           "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu"}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg,
                        reward_fn=lambda solution_str: float(len(solution_str)))
    actor = trainer.actor
    assert lora.is_peft(actor) and actor.peft_config["default"].r == 4
    trainer.fit([{"prompt": f"What is {i} + 1?"} for i in range(4)])
    trained_b = [p for n, p in actor.named_parameters() if "lora_B" in n]
    assert trained_b and any(p.abs().sum() > 0 for p in trained_b)  # the adapters learned (B starts at 0)
    frozen = {n: p for n, p in actor.named_parameters() if "lora_" not in n}
    assert all(not p.requires_grad for p in frozen.values())

    ids = torch.tensor([[3, 17, 42, 9, 11, 5]])
    want = outputs(actor, ids)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    merged, info = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"]
    got = outputs(merged, ids)
    assert (got - want).abs().max().item() <= 1e-4 * (1 + want.abs().max().item())
    assert (outputs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), ids) - want).abs().max() > 1e-3

    # the adapter folder is peft's own: it loads onto the base
    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, base_before[k])
    adapted = peft.PeftModel.from_pretrained(fresh, str(ckpt / lora.ADAPTER))
    assert (outputs(adapted, ids) - want).abs().max().item() <= 1e-5 * (1 + want.abs().max().item())

    # verl-fast export merges from the checkpoint's shards (no model in memory) and copies the adapter
    out = checkpoint.export(str(ckpt), str(tmp_path / "exported"))
    again, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (outputs(again, ids) - want).abs().max().item() <= 1e-4 * (1 + want.abs().max().item())
    assert (out / lora.ADAPTER / "adapter_config.json").is_file()


def test_lora_twice_is_refused(tmp_path):
    path = save_tiny_model(tmp_path / "base", family="qwen2", seed=7)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                                peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="already has PEFT adapters"):
        RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(path),
                  config={"actor": {"lora": {"r": 4}}, "rollout": {"type": "hf"},
                          "trainer": {"output_dir": str(tmp_path / "r"), "device": "cpu"}})


def test_a_lora_actors_reference_is_its_base_with_the_adapters_disabled(tmp_path):
    """KL with fresh adapters: no copy of the base is kept; the reference log-probs are the actor's at the
    start and stay there while the adapters train. Adapters given already trained keep a copy."""
    path = save_tiny_model(tmp_path / "base", family="qwen2", seed=7)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = {"actor": {"lr": 5e-2, "use_kl_loss": True, "micro_batch_size": 4,
                     "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}},
           "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "trainer": {"train_batch_size": 2, "output_dir": str(tmp_path / "run"), "progress_bar": False,
                       "plot": False, "device": "cpu"}}
    trainer = RLTrainer(actor_model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer=tok,
                        config=cfg, reward_fn=lambda solution_str: float(len(solution_str) % 3))
    s = trainer.strategy
    assert s.has_reference and s.ref is None and s.ref_is_base
    exp = trainer.make_experience(trainer.processor.encode_all([{"prompt": "What is 1 + 1?"},
                                                                {"prompt": "Name a colour."}]), {})
    micro = [torch.arange(exp.input_ids.shape[0])]
    start = s.actor_logprobs(exp, micro)
    torch.testing.assert_close(s.ref_logprobs(exp, micro), start, rtol=0, atol=0)
    for _ in range(2):
        trainer.update_actor(exp)
    assert (s.actor_logprobs(exp, micro) - start).abs().max() > 1e-3  # the adapters moved
    torch.testing.assert_close(s.ref_logprobs(exp, micro), start, rtol=0, atol=0)  # the reference did not
    assert all(p.requires_grad for n, p in s.actor.named_parameters() if "lora_" in n)  # adapters back on

    trained = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                  peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    assert not lora.starts_as_base(trained)
    cfg["actor"].pop("lora")
    cfg["trainer"]["output_dir"] = str(tmp_path / "run2")
    again = RLTrainer(actor_model=trained, tokenizer=tok, config=cfg,
                      reward_fn=lambda solution_str: float(len(solution_str) % 3))
    assert again.strategy.has_reference and again.strategy.ref is not None and not again.strategy.ref_is_base
