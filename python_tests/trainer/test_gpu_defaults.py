"""What a config that names no precision or memory key gets: bf16 compute over fp32 masters and TF32 on a
GPU, today's choices on the CPU; gradient checkpointing and the refusal of a run that cannot fit, from
the memory plan (strategies/memory_plan.py)."""

import dataclasses
import json

import pytest
import torch
import transformers

from tiny_models import build_config, build_model, tiny_model
from verl_fast.config import LoraConfig, from_dict
from verl_fast.strategies import memory_plan
from verl_fast.strategies.fsdp_strategy import autocast_dtype, use_tf32
from verl_fast.trainer.launch import auto_settings

GIB = 2**30
# Qwen2.5-7B's published shape (config.json of Qwen/Qwen2.5-7B): 7,615,616,512 parameters
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def test_no_precision_key_is_bf16_on_a_gpu_and_todays_choice_on_the_cpu(monkeypatch):
    cfg = from_dict({"actor": {"model_name": "m"}})
    assert cfg.actor.autocast is None and cfg.actor.mixed_precision == "auto" and cfg.trainer.tf32 is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert autocast_dtype(cfg.actor.autocast, torch.device("cuda")) is torch.bfloat16
    # the CPU keeps fp32 whatever it supports (auto is the opt-in for AVX512-BF16 / AMX CPUs)
    for native in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=native: v)
        assert autocast_dtype(cfg.actor.autocast, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # a GPU without bf16: fp32
    assert autocast_dtype(None, torch.device("cuda")) is None


def test_print_config_names_what_the_defaults_resolve_to(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu = auto_settings(from_dict({"trainer": {"device": "cuda"}}))
    assert gpu["resolved on"] == "cuda" and gpu["actor.autocast"] == "bfloat16" and gpu["trainer.tf32"] is True
    assert gpu["actor.use_dynamic_bsz"] is True and "free memory" in gpu["actor.gradient_checkpointing"]
    assert gpu["actor.mixed_precision"].startswith("bfloat16")
    cpu = auto_settings(from_dict({"trainer": {"device": "cpu"}}))
    assert cpu == {"resolved on": "cpu", "actor.autocast": "none", "trainer.tf32": False,
                   "actor.use_dynamic_bsz": False, "actor.gradient_checkpointing": False,
                   "actor.mixed_precision": "none"}
    set_by_hand = auto_settings(from_dict({"trainer": {"device": "cuda", "tf32": False},
                                           "actor": {"autocast": "none", "gradient_checkpointing": True}}))
    assert set_by_hand["actor.autocast"] == "none" and set_by_hand["trainer.tf32"] is False
    assert "actor.gradient_checkpointing" not in set_by_hand


def test_tf32_is_on_for_a_gpu_run_and_left_alone_on_the_cpu():
    # saved and restored by hand: cuBLAS's flags live behind the module's __getattr__, which
    # pytest's monkeypatch (9.2) cannot undo
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        use_tf32(None, torch.device("cpu"))
        assert torch.backends.cuda.matmul.allow_tf32 is False
        use_tf32(None, torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
        use_tf32(False, torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _folder(tmp_path, **shape):
    transformers.Qwen2Config(**shape).save_pretrained(tmp_path)
    return str(tmp_path)


def test_shape_from_the_config_alone_counts_the_published_7b(tmp_path):
    shape = memory_plan.shape_from_folder(_folder(tmp_path, **QWEN25_7B), None)
    assert shape.parameters == 7_615_616_512 and shape.trained == shape.parameters
    assert (shape.layers, shape.hidden, shape.width) == (28, 3584, 3584 + 18944)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_lora_parameters_equal_pefts_count(targets):
    peft = pytest.importorskip("peft")
    model = build_model("qwen2")
    want = peft.get_peft_model(build_model("qwen2"), peft.LoraConfig(r=8, target_modules=targets))
    trained = sum(p.numel() for p in want.parameters() if p.requires_grad)
    assert memory_plan.lora_parameters(model.named_modules(), 8, targets) == trained


def test_adapted_width_is_the_same_from_the_folder_and_from_the_built_peft_model(tmp_path):
    """LoRA's activations (a second input cast, the output sum) are counted per unit of the adapted
    layers' (in + out) width: the same sum from the config alone and from peft's wrapped model."""
    peft = pytest.importorskip("peft")
    built = peft.get_peft_model(build_model("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    want = sum(m.in_features + m.out_features for name, m in build_model("qwen2").named_modules()
               if name.endswith(("q_proj", "down_proj")))
    assert memory_plan.shape_of(built).adapted == want > 0
    assert memory_plan.shape_of(build_model("qwen2")).adapted == 0
    shape = memory_plan.shape_from_folder(_folder(tmp_path, **QWEN25_7B), LoraConfig(r=64))
    assert shape.adapted == shape.trained // 64 == 28 * (6 * 3584 + 18944 + 3584 * 3 + 512 * 2 + 18944 * 2)
    cfg = from_dict({"actor": {"lora": {"r": 64}}})
    plain = memory_plan.plan(cfg, dataclasses.replace(shape, adapted=0), 139 * GIB, False, True)
    with_lora = memory_plan.plan(cfg, shape, 139 * GIB, False, True)
    assert with_lora.per_token - plain.per_token == memory_plan.ADAPTER_ACTIVATION_BYTES * shape.adapted


def test_the_7b_full_fine_tune_fits_one_h200_with_8bit_states_and_not_with_fp32_adamw(tmp_path):
    shape = memory_plan.shape_from_folder(_folder(tmp_path, **QWEN25_7B), None)
    free = 139 * GIB
    work = {"rollout": {"n": 8, "max_new_tokens": 256}, "trainer": {"max_prompt_length": 64}}
    fp32 = from_dict(work)
    p = memory_plan.plan(fp32, shape, free, needs_reference=False, peft=False)
    # 4 (weights) + 4 (gradients) + 8 (AdamW) + 2 + 2 (the passes' and the decode's bf16 copies) bytes each
    assert p.static_bytes == 20 * shape.parameters and not p.fits()
    line = memory_plan.refusal(p, fp32)
    assert "\n" not in line and "actor.lora" in line and "actor.optimizer=adamw_8bit" in line and "GiB" in line
    eight = from_dict({**work, "actor": {"optimizer": "adamw_8bit"}})
    p8 = memory_plan.plan(eight, shape, free, needs_reference=False, peft=False)
    assert p8.static_bytes == 14 * shape.parameters and p8.fits()
    # a KL reference copy (fp32) on top no longer leaves one prompt group room without checkpointing
    ref = memory_plan.plan(eight, shape, free, needs_reference=True, peft=False)
    assert ref.static_bytes == 18 * shape.parameters


def test_lora_7b_fits_and_checkpointing_turns_on_only_where_memory_needs_it(tmp_path):
    lora = {"r": 64}
    shape = memory_plan.shape_from_folder(_folder(tmp_path, **QWEN25_7B), LoraConfig(**lora))
    assert 150e6 < shape.trained < 170e6  # 64 x (in + out) over 7 projections x 28 layers: 161,480,704
    cfg = from_dict({"actor": {"lora": lora}, "rollout": {"n": 8, "max_new_tokens": 256}})
    p = memory_plan.plan(cfg, shape, 139 * GIB, needs_reference=False, peft=True)
    assert p.fits() and not p.checkpointing

    def with_room_for(tokens):  # free memory whose room holds ``tokens`` unchecked tokens' activations
        return memory_plan.plan(cfg, shape, p.static_bytes + tokens * p.per_token / memory_plan.MEMORY_FRACTION,
                                False, True)

    # a 7B forward costs more to recompute than a micro-batch of ~2.4k tokens costs to add: room for half a
    # group (an 80 GB card's case) splits the update instead; room for a fifth of a group recomputes
    assert 2000 < p.worthwhile_tokens < 0.5 * p.group_tokens
    half, fifth = with_room_for(0.5 * p.group_tokens), with_room_for(0.2 * p.group_tokens)
    assert half.fits() and not half.checkpointing
    assert fifth.fits() and fifth.checkpointing


def test_a_small_model_recomputes_rather_than_splitting_a_prompt_group(tmp_path):
    """At the 0.5B shape a micro-batch more costs more than recomputing ~38k tokens' forward: room for less
    than one prompt group turns checkpointing on (the measured 0.25 -> 0.40 s of a 16k-token budget
    against 0.32 s checkpointed)."""
    shape = memory_plan.shape_from_folder(_folder(tmp_path, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                                  num_hidden_layers=24, num_attention_heads=14,
                                                  num_key_value_heads=2, tie_word_embeddings=True), None)
    cfg = from_dict({"rollout": {"n": 8, "max_new_tokens": 256}})
    p = memory_plan.plan(cfg, shape, 139 * GIB, needs_reference=False, peft=False)
    assert p.worthwhile_tokens > p.group_tokens and not p.checkpointing
    half = memory_plan.plan(cfg, shape, p.static_bytes + 0.5 * p.group_tokens * p.per_token / memory_plan.MEMORY_FRACTION,
                            False, False)
    assert half.fits() and half.checkpointing


def test_checkpointing_stays_off_on_the_cpu():
    cfg = from_dict({})
    assert memory_plan.wants_checkpointing(cfg, build_model("qwen2"), torch.device("cpu"), False, False) is False


def test_an_8bit_optimizer_trains_a_tiny_model_like_adamw():
    """torchao's AdamW8bit (actor.optimizer=adamw_8bit) through the strategy's optimizer factory: the
    loss falls as under fp32 AdamW (its block-quantised moments round the step, not its direction).
    Small tensors (< 4096 elements) keep fp32 moments in torchao; the 64 x 128 blocks here quantise."""
    pytest.importorskip("torchao")
    from verl_fast.strategies.fsdp_strategy import adamw

    losses = {}
    for kind in ("adamw", "adamw_8bit"):
        model = tiny_model("qwen2", seed=0)
        opt = adamw(model, 1e-2, 0.0, kind)
        ids = torch.randint(0, 320, (4, 16), generator=torch.Generator().manual_seed(0))
        curve = []
        for _ in range(6):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(float(loss.detach()))
        losses[kind] = curve
    for kind, curve in losses.items():
        assert curve[-1] < 0.9 * curve[0], (kind, curve)
    assert abs(losses["adamw_8bit"][-1] - losses["adamw"][-1]) < 0.1 * losses["adamw"][0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_merged_adapters_compute_what_pefts_forward_does(device, request):
    """The compiled decode's LoRA layers: one plain linear holding W + scale * B @ A (hf_decode.merge_adapters)
    against a float64 reference of peft's forward (base product plus the scaled adapter path)."""
    peft = pytest.importorskip("peft")
    from verl_fast.rollout.hf_decode import merge_adapters

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products in float32 (a GPU run's default is TF32)
    request.addfinalizer(lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", tf32))
    torch.manual_seed(0)
    model = peft.get_peft_model(build_model("qwen2"), peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # peft starts B at zero: the merge would be trivial
    model.to(device).eval()
    ids = torch.randint(0, 512, (2, 9), device=device)
    want = model(input_ids=ids).logits.double()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, layer.base_layer.in_features, dtype=torch.float64, device=device)
    a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    ref = x @ layer.base_layer.weight.double().T + layer.base_layer.bias.double() + 4.0 * (x @ a.T) @ b.T
    done, copies = [], {}
    merge_adapters(model, None, copies, done)
    try:
        assert len(done) == 2 * 7 and all(type(getattr(p, n)) is torch.nn.Linear for p, n, _ in done)
        plain = model.base_model.model.model.layers[0].self_attn.q_proj
        torch.testing.assert_close(plain(x.float()).double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(input_ids=ids).logits.double(), want, atol=1e-4, rtol=1e-4)
    finally:
        for parent, attr, adapted in done:
            setattr(parent, attr, adapted)
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj).__module__.startswith("peft")
    base = layer.base_layer.weight.detach().clone()
    ref_w = base.double() + 4.0 * b @ a
    merge_adapters(model, torch.bfloat16, copies, done := [])  # the kept copies are refreshed, in bf16
    assert all(getattr(p, n).weight.dtype == torch.bfloat16 for p, n, _ in done)
    assert torch.equal(layer.base_layer.weight, base)  # the float32 base summed into a temporary, not itself
    got = model.base_model.model.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(got.double(), ref_w.to(torch.bfloat16).double(), rtol=0, atol=0)  # one rounding
    for parent, attr, adapted in done:
        setattr(parent, attr, adapted)
    # a LoRA actor's bf16 base: the sum made in the bf16 copy itself, the factors taken in bf16
    for _, _, adapted in done:
        adapted.base_layer.to(torch.bfloat16)
    merge_adapters(model, torch.bfloat16, copies, done := [])
    assert torch.equal(layer.base_layer.weight.float(), base.to(torch.bfloat16).float())  # the base untouched
    got = model.base_model.model.model.layers[0].self_attn.q_proj.weight.double()
    ref_w = base.to(torch.bfloat16).double() + 4.0 * b @ a
    # bf16 factors (as autocast gives the training passes' adapter products): within bf16's relative
    # error of each term of the sum, not only of the result
    bound = 2**-7 * (base.abs().double() + 4.0 * b.abs() @ a.abs())
    assert ((got - ref_w).abs() <= bound).all(), ((got - ref_w).abs() / bound).max()
    for parent, attr, adapted in done:
        setattr(parent, attr, adapted)


def test_8bit_optimizer_states_checkpoint_and_resume_bit_for_bit(tmp_path):
    """actor.optimizer=adamw_8bit through the trainer: two steps (the schedule sets torchao's tensor
    rate in place), a checkpoint, and a second trainer resumed from it holds the same weights and the
    same quantised moments."""
    pytest.importorskip("torchao")
    from tiny_models import build_tokenizer
    from verl_fast.checkpoint import sharded as checkpoint
    from verl_fast.trainer.rl_trainer import RLTrainer

    tok = build_tokenizer()

    def trainer():
        cfg = {"actor": {"optimizer": "adamw_8bit", "lr": 1e-3, "lr_scheduler": "linear"},
               "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
               "trainer": {"train_batch_size": 2, "total_steps": 4, "output_dir": str(tmp_path), "progress_bar": False,
                           "plot": False, "device": "cpu"}}
        return RLTrainer(actor_model=build_model("qwen2", vocab_size=len(tok), hidden_size=128, intermediate_size=256),
                         tokenizer=tok, config=cfg,
                         reward_fn=lambda solution_str, ground_truth: float(len(solution_str) % 2))

    first = trainer()
    rows = first.processor.encode_all([{"prompt": [{"role": "user", "content": f"hi {i}"}],
                                        "reward_model": {"ground_truth": "0"}, "data_source": "x"} for i in range(4)])
    for s in range(2):
        first.train_step(rows[2 * s: 2 * s + 2])
    states = first.strategy.optimizer.state
    assert any(type(st["exp_avg"]).__name__ == "OptimState8bit" for st in states.values())
    first.save()
    second = trainer()
    second.strategy.load(checkpoint.latest_valid(str(tmp_path)))
    for (name, a), b in zip(first.actor.named_parameters(), second.actor.parameters()):
        assert torch.equal(a, b), name
    plain = lambda t: t.dequantize() if hasattr(t, "dequantize") else t  # noqa: E731
    got = second.strategy.optimizer.state
    for p1, p2 in zip(first.actor.parameters(), second.actor.parameters()):
        if p1 in states:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(plain(states[p1][key]), plain(got[p2][key])), key
