"""``actor.mixed_precision: bfloat16`` for an unsharded actor: bf16 copies of the fp32 weights in the
passes, fp32 gradients and AdamW steps on the masters (``strategies/bf16_compute``)."""

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.config import from_dict
from verl_fast.strategies.bf16_compute import BF16Compute
from verl_fast.strategies.fsdp_strategy import computes_in_bf16
from verl_fast.strategies.sharding import Sharding
from verl_fast.trainer.rl_trainer import RLTrainer

from tiny_models import save_tiny_model


def tiny(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def token_logprob_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The mean log-prob of each next token (a training pass's shape of loss), in float64."""
    logits = model(ids).logits[:, :-1].double()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


@pytest.mark.parametrize("rows, length, seed", [(1, 5, 0), (3, 17, 1), (4, 33, 2), (2, 64, 3)])
def test_gradients_within_bf16_error_of_float64(rows, length, seed):
    model = tiny(seed)
    ids = torch.randint(0, 96, (rows, length), generator=torch.Generator().manual_seed(seed))
    reference = copy.deepcopy(model).double()
    token_logprob_loss(reference, ids).backward()
    want = grads(reference)

    with BF16Compute(model).active():
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        token_logprob_loss(model, ids).backward()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the masters are back
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    got = grads(model)
    error = float((got - want).norm() / want.norm())

    autocast = copy.deepcopy(reference).float()  # the other bf16 path: fp32 weights under autocast
    autocast.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = token_logprob_loss(autocast, ids)
    loss.backward()
    autocast_error = float((grads(autocast) - want).norm() / want.norm())
    assert error < 0.05, error  # bf16's 8 bits of mantissa through two layers, not a wrong gradient (~1)
    assert error < 4 * autocast_error + 1e-3, (error, autocast_error)


def test_copies_follow_the_masters_and_gradients_accumulate():
    model = tiny()
    bf16 = BF16Compute(model)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # a step between passes: the next copies are made from these masters
    with bf16.active():
        assert all(p.data.data_ptr() == c.data_ptr() for p, c in zip(bf16.params, bf16.copies))
        halved = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(h, m.to(torch.bfloat16)) for h, m in zip(halved, masters))

    with bf16.active():
        token_logprob_loss(model, ids).backward()
    first = grads(model)
    with bf16.active():  # a second pass's gradient adds to the fp32 one already there
        token_logprob_loss(model, ids).backward()
    assert torch.allclose(grads(model), 2 * first, rtol=1e-6, atol=0)
    assert all(torch.equal(p.detach(), m) for p, m in zip(model.parameters(), masters))  # no write to the masters


def test_a_failing_pass_leaves_the_masters_back_and_its_gradients_dropped(monkeypatch):
    """An out-of-memory pass (the update re-plans and retries it): the fp32 masters are back on every
    parameter, no gradient of the failed pass is summed (summing allocates, which could fail again)."""
    model = tiny()
    bf16 = BF16Compute(model)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    masters = [p.data for p in bf16.params]
    summed = []
    monkeypatch.setattr(bf16, "accumulate", lambda: summed.append(True))
    with pytest.raises(torch.OutOfMemoryError):
        with bf16.active():
            token_logprob_loss(model, ids).backward()
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert not summed
    assert all(p.data_ptr() == m.data_ptr() and p.dtype == torch.float32 for p, m in zip(bf16.params, masters))
    assert all(p.grad is None for p in bf16.params)


def test_micro_batches_add_up_in_fp32():
    """Gradients of several micro-batches inside one ``active`` sum in fp32 (``accumulate`` after
    each backward), exactly as their fp32 conversions added one by one; bf16 sums would round."""
    model = tiny()
    bf16 = BF16Compute(model)
    batches = [torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    each = []
    for ids in batches:
        with bf16.active():
            token_logprob_loss(model, ids).backward()
        each.append(grads(model).float())
        model.zero_grad(set_to_none=True)
    with bf16.active():
        for ids in batches:
            token_logprob_loss(model, ids).backward()
            bf16.accumulate()
    want = each[0]
    for g in each[1:]:
        want = want + g
    assert torch.equal(grads(model).float(), want)


def test_updates_below_bf16_resolution_accumulate_in_the_masters():
    """Why fp32 masters: at lr 1e-6 an AdamW step moves a weight of ~0.02 by ~1e-6, under bf16's
    spacing there (~1.2e-4): bf16 weights alone never move, the masters do."""
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    model, alone = tiny(), tiny().to(torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    bf16 = BF16Compute(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    opt_alone = torch.optim.AdamW(alone.parameters(), lr=1e-6, weight_decay=0.0)
    for _ in range(10):
        with bf16.active():
            token_logprob_loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
        token_logprob_loss(alone, ids).backward()
        opt_alone.step()
        opt_alone.zero_grad()
    moved = torch.cat([(p.detach() - s).abs().flatten() for p, s in zip(model.parameters(), start)])
    assert 5e-6 < float(moved.max()) < 2e-5  # ten steps of ~lr each
    assert float((moved > 0).double().mean()) > 0.9
    # in bf16 alone only weights within ~2e-4 of 0 (where bf16's spacing is finer than the step) move
    changed = torch.cat([(p.detach() != s.to(torch.bfloat16)).flatten() for p, s in zip(alone.parameters(), start)])
    assert float(changed.double().mean()) < 0.05


def test_auto_and_explicit_settings():
    model = tiny()
    layout = Sharding("none")
    cfg = lambda mp: from_dict({"actor": {"mixed_precision": mp}})  # noqa: E731
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not computes_in_bf16(model, cfg("auto"), layout, cpu, torch.bfloat16)  # auto: a GPU only
    assert computes_in_bf16(model, cfg("auto"), layout, cuda, torch.bfloat16)
    assert not computes_in_bf16(model, cfg("auto"), layout, cuda, None)  # no bf16 autocast: fp32 asked for
    assert not computes_in_bf16(tiny().to(torch.bfloat16), cfg("auto"), layout, cuda, torch.bfloat16)
    assert computes_in_bf16(model, cfg("bfloat16"), layout, cpu, None)
    assert not computes_in_bf16(model, cfg("none"), layout, cuda, torch.bfloat16)
    assert not computes_in_bf16(model, cfg("bfloat16"), Sharding("fsdp2", mixed_precision=True), cuda, None)
    section = from_dict({"critic": {"mixed_precision": "bfloat16"}}).critic
    with pytest.raises(ValueError, match=r"critic.mixed_precision is not supported with critic.strategy=none"):
        Sharding.from_config(section, "critic", 1)
    assert Sharding.from_config(cfg("bfloat16").actor, "actor", 1).mixed_precision


PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}, "data_source": "toy"}
           for a, b in [(1, 2), (3, 4)]]


def test_trainer_update_on_bf16_copies_matches_autocast(tmp_path):
    """The same experience through a PPO-style update (old log-probs, two mini-batches) with
    ``mixed_precision: bfloat16`` and with fp32 weights under autocast: log-probs and the update's
    weights within bf16 error of each other; the weights stay fp32."""
    path = save_tiny_model(tmp_path / "qwen2", family="qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    trainers = {}
    for mp in ("none", "bfloat16"):
        cfg = {"actor": {"lr": 1e-3, "mixed_precision": mp, "autocast": "bfloat16", "ppo_mini_batch_size": 4,
                         "micro_batch_size": 2},
               "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6, "temperature": 1.0},
               "algorithm": {"type": "grpo"},
               "trainer": {"train_batch_size": 2, "output_dir": str(tmp_path / mp), "progress_bar": False,
                           "plot": False, "device": "cpu"}}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainers[mp] = RLTrainer(actor_model=model, tokenizer=tok, config=cfg,
                                 reward_fn=lambda solution_str: float(len(solution_str) % 3))
    plain, bf16 = trainers["none"], trainers["bfloat16"]
    assert plain.strategy.bf16 is None and bf16.strategy.bf16 is not None
    exp = bf16.make_experience(bf16.processor.encode_all(PROMPTS), {})
    assert exp.old_logprobs is not None  # two mini-batches: the old-log-prob pass ran, on the copies
    want = plain._old_logprobs(exp)
    mask = exp.response_mask.bool()
    assert float((exp.old_logprobs - want)[mask].abs().max()) < 0.1  # bf16 log-probs of a 96-token vocab
    before = [p.detach().clone() for p in bf16.actor.parameters()]
    plain.update_actor(exp)
    bf16.update_actor(exp)
    assert {p.dtype for p in bf16.actor.parameters()} == {torch.float32}
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(bf16.actor.parameters(), before)])
    diff = torch.cat([(p.detach() - q.detach()).flatten()
                      for p, q in zip(bf16.actor.parameters(), plain.actor.parameters())])
    assert float(moved.norm()) > 0
    assert float(diff.norm() / moved.norm()) < 0.2  # the same update but for bf16 rounding in both


def test_a_lora_actors_frozen_base_is_kept_in_bf16_and_trains_as_under_autocast(tmp_path):
    """A LoRA actor with ``mixed_precision: bfloat16`` (the auto on a GPU under bf16 autocast): its frozen
    base in bf16 for good (the reference too: the base, adapters disabled), the adapters fp32; the same GRPO update as
    the fp32 base under autocast within bf16 error; the plan counts the base at 2 bytes."""
    pytest.importorskip("peft")
    path = save_tiny_model(tmp_path / "qwen2", family="qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    trainers = {}
    for mp in ("none", "bfloat16"):
        cfg = {"actor": {"lr": 1e-2, "mixed_precision": mp, "autocast": "bfloat16", "micro_batch_size": 4,
                         "use_kl_loss": True, "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}},
               "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6, "temperature": 1.0},
               "algorithm": {"type": "grpo"},
               "trainer": {"train_batch_size": 2, "output_dir": str(tmp_path / mp), "progress_bar": False,
                           "plot": False, "device": "cpu"}}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainers[mp] = RLTrainer(actor_model=model, tokenizer=tok, config=cfg,
                                 reward_fn=lambda solution_str: float(len(solution_str) % 3))
    plain, bf16 = trainers["none"], trainers["bfloat16"]
    assert not plain.strategy.base_in_bf16 and bf16.strategy.base_in_bf16
    assert bf16.strategy.bf16 is not None  # set by hand: the adapters too run on bf16 copies
    frozen = {p.dtype for p in bf16.actor.parameters() if not p.requires_grad}
    trained = {p.dtype for p in bf16.actor.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    assert {p.dtype for p in plain.actor.parameters()} == {torch.float32}
    assert bf16.strategy.ref is None and bf16.strategy.ref_is_base  # the reference: the bf16 base, no copy
    exp = bf16.make_experience(bf16.processor.encode_all(PROMPTS), {})
    before = {n: p.detach().clone() for n, p in bf16.actor.named_parameters() if p.requires_grad}
    plain.update_actor(exp)
    bf16.update_actor(exp)
    moved = torch.cat([(p.detach() - before[n]).flatten() for n, p in bf16.actor.named_parameters() if n in before])
    ref = dict(plain.actor.named_parameters())
    diff = torch.cat([(p.detach() - ref[n].detach()).flatten() for n, p in bf16.actor.named_parameters() if n in before])
    assert float(moved.norm()) > 0
    assert float(diff.norm() / moved.norm()) < 0.2  # the same adapter update but for bf16 rounding
    assert {p.dtype for p in bf16.actor.parameters() if not p.requires_grad} == {torch.bfloat16}
    # the export (adapters merged into the bf16 base) says the dtype its weights are in
    bf16.save()
    (step,) = (tmp_path / "bfloat16" / "checkpoints").glob("step_*")
    out = checkpoint.export(str(step), str(tmp_path / "exported"))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {p.dtype for p in AutoModelForCausalLM.from_pretrained(out, dtype="auto").parameters()} == {torch.bfloat16}


def test_the_auto_keeps_a_lora_base_in_bf16_on_a_gpu_under_bf16_autocast_only():
    from verl_fast.strategies.fsdp_strategy import keeps_base_in_bf16

    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny(), peft.LoraConfig(r=4, target_modules="all-linear"))
    cfg, one = from_dict({}), Sharding.from_config(from_dict({}).actor, "actor", 1)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert keeps_base_in_bf16(lora, cfg, one, cuda, torch.bfloat16)
    assert not keeps_base_in_bf16(lora, cfg, one, cpu, None)
    assert not keeps_base_in_bf16(lora, cfg, one, cuda, None)
    assert not keeps_base_in_bf16(tiny(), cfg, one, cuda, torch.bfloat16)  # no LoRA: BF16Compute's masters
    # and the adapters' passes on bf16 copies there (peft would copy each adapted layer's input to fp32)
    assert computes_in_bf16(lora, cfg, one, cuda, torch.bfloat16)
    assert not computes_in_bf16(lora, cfg, one, cpu, None) and not computes_in_bf16(lora, cfg, one, cuda, None)
    assert not keeps_base_in_bf16(lora, from_dict({"actor": {"mixed_precision": "none"}}), one, cuda, torch.bfloat16)


def test_the_plan_counts_a_lora_base_kept_in_bf16_at_two_bytes():
    from verl_fast.strategies import memory_plan

    shape = memory_plan.Shape(parameters=1_000_000 + 10_000, trained=10_000, layers=2, width=128, hidden=64)
    auto = memory_plan.plan(from_dict({"actor": {"lora": {"r": 4}}}), shape, 2**34, False, peft=True)
    none = memory_plan.plan(from_dict({"actor": {"lora": {"r": 4}, "mixed_precision": "none"}}), shape, 2**34,
                            False, peft=True)
    # base 2, adapters 4 + their gradients 4 + AdamW 8 + their passes' bf16 copies 2, the decode's bf16
    # copies 2 per parameter
    assert auto.static_bytes == 1_000_000 * 2 + 10_000 * 18 + 2 * shape.parameters
    # fp32 base 4, the passes' casts and the decode's copies 2 + 2
    assert none.static_bytes == shape.parameters * 4 + 10_000 * 12 + 4 * shape.parameters


def test_the_plan_counts_the_asynchronous_modes_rollout_copies():
    from verl_fast.strategies import memory_plan

    shape = memory_plan.Shape(parameters=1_000_000, trained=1_000_000, layers=2, width=128, hidden=64)
    base = {"algorithm": {"rollout_correction": True}}
    off = memory_plan.plan(from_dict(base), shape, 2**34, False, peft=False).static_bytes
    for trainer, extra in (({"async_mode": "one_step"}, 2 * 1_000_000),  # bf16 copy of what trains
                           ({"async_mode": "full", "async_workers": 2}, 2 * 1_000_000 * 5)):  # buffer + 2 x 2
        cfg = from_dict({**base, "trainer": trainer})
        assert memory_plan.plan(cfg, shape, 2**34, False, peft=False).static_bytes == off + extra
    lora = memory_plan.Shape(parameters=1_010_000, trained=10_000, layers=2, width=128, hidden=64)
    one_step = from_dict({**base, "trainer": {"async_mode": "one_step"}, "actor": {"lora": {"r": 4}}})
    assert memory_plan.plan(one_step, lora, 2**34, False, peft=True).static_bytes == \
        memory_plan.plan(from_dict({**base, "actor": {"lora": {"r": 4}}}), lora, 2**34, False, peft=True).static_bytes \
        + 2 * 10_000  # the adapters only: the base is shared
