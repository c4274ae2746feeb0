"""trainer.async_mode=full with rollout workers as CPU processes: the gloo weight group over two
workers (the split placement's transport), the shared-buffer transport (one GPU's, here in host
shared memory), bounded staleness, resume after a checkpoint with work in flight."""

import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_toy import PROMPTS, reward, tiny_path  # noqa: F401 (tiny_path: a fixture)
from verl_fast import openmp_env
from verl_fast.async_rl.full import FullAsyncRollout, placement
from verl_fast.async_rl.records import Sampled, check_staleness
from verl_fast.records.generation import pad_completions
from verl_fast.trainer.rl_trainer import RLTrainer


def trainer(path, out, steps=4, transport_kind=None, lora=None, autocast=None, **t):
    actor = {"lr": 1e-2, "micro_batch_size": 8, **({"lora": lora} if lora else {}),
             **({"autocast": autocast} if autocast else {})}
    cfg = {"actor": actor,
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 12},
           "reward_fn": {"type": "gsm8k"},
           "algorithm": {"type": "grpo", "rollout_correction": True},
           "trainer": {"total_steps": steps, "train_batch_size": 2, "output_dir": str(out), "progress_bar": False,
                       "plot": False, "device": "cpu", "async_mode": "full", "loggers": ["jsonl"], **t}}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tr = RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(path), reward_fn=reward, config=cfg)
    if transport_kind is not None:
        tr.async_rollout = FullAsyncRollout(tr.cfg, tr.strategy.actor, tr.tokenizer, tr.rollout, tr._seed,
                                            transport_kind=transport_kind)
    return tr


def test_two_gloo_workers_bounded_staleness_and_sigterm_then_resume_trains_each_step_once(tiny_path, tmp_path):
    out = tmp_path / "run"
    tr = trainer(tiny_path, out, max_staleness=2, async_workers=2)
    update = tr.update_actor

    def update_then_sigterm(exp):  # SIGTERM inside step 2, with steps 3 and 4 handed to the workers
        result = update(exp)
        if tr.step == 1:
            signal.raise_signal(signal.SIGTERM)
        return result

    tr.update_actor = update_then_sigterm
    history = [h for h in tr.fit(PROMPTS) if "actor/pg_loss" in h]
    assert tr.stopped and [h["step"] for h in history] == [1, 2]
    for h in history:
        assert 0 <= h["async/staleness_max"] <= 2
        assert sum(v for k, v in h.items() if k.startswith("async/staleness_hist/")) == pytest.approx(1.0)
        assert torch.isfinite(torch.tensor(h["actor/pg_loss"]))
    assert not tr.async_rollout._procs  # fit stopped its workers
    # resumed from step 2's checkpoint: steps 3 and 4 are handed out and trained once each
    tr = trainer(tiny_path, out, max_staleness=2, async_workers=2)
    taken = []
    take = tr.async_rollout.take
    tr.async_rollout.take = lambda step, batch, m: taken.append(step) or take(step, batch, m)
    resumed = [h for h in tr.fit(PROMPTS) if "actor/pg_loss" in h]
    assert taken == [2, 3] and [h["step"] for h in resumed] == [1, 2, 3, 4]
    assert all(h["async/staleness_max"] <= 2 for h in resumed)


def test_shared_buffer_without_partial_rollouts_never_mixes_versions(tiny_path, tmp_path):
    tr = trainer(tiny_path, tmp_path / "run", steps=3, transport_kind="shared", partial_rollouts=False)
    history = [h for h in tr.fit(PROMPTS) if "actor/pg_loss" in h]
    assert len(history) == 3
    assert all(h["async/mixed_version_sequences"] == 0.0 and h["async/staleness_max"] <= 1 for h in history)


def test_placement_splits_gpus_and_shares_one():
    assert placement(2, torch.device("cpu"), 0) == (["cpu", "cpu"], "group", "gloo")
    assert placement(2, torch.device("cuda:0"), 1) == (["cuda:0", "cuda:0"], "shared", "nccl")
    assert placement(3, torch.device("cuda:0"), 4) == (["cuda:1", "cuda:2", "cuda:3"], "group", "nccl")
    assert placement(1, torch.device("cuda:2"), 4) == (["cuda:0"], "group", "nccl")
    with pytest.raises(ValueError, match="async_workers=4 needs a GPU each"):
        placement(4, torch.device("cuda:0"), 4)


def test_a_token_older_than_max_staleness_is_refused():
    gen = pad_completions([[1, 2, 3], [4]], [[-1.0] * 3, [-1.0]], [0, 0], 0)
    sampled = Sampled(5, gen, torch.tensor([[3, 4, 5], [5, -1, -1]]))
    check_staleness(sampled, 5, 2)
    with pytest.raises(RuntimeError, match="3 versions old"):
        check_staleness(sampled, 6, 2)


def test_a_lora_actors_workers_get_the_adapters_merged_into_the_base(tiny_path, tmp_path):
    """Full mode with ``actor.lora``: what is pushed is the base model's parameters by name with each
    adapted weight merged (peft's own merge_and_unload gives the same tensors), and a run trains."""
    peft = pytest.importorskip("peft")
    import copy

    from verl_fast.async_rl.transport import PushedWeights

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      init_lora_weights=False))
    pushed = PushedWeights(lora)
    want = dict(copy.deepcopy(lora).merge_and_unload().named_parameters())
    assert pushed.names == list(want) and pushed.numel == sum(t.numel() for t in want.values())
    for name, tensor in zip(pushed.names, pushed):
        torch.testing.assert_close(tensor, want[name], atol=1e-6, rtol=1e-6, msg=name)

    tr = trainer(tiny_path, tmp_path / "run", steps=2, lora={"r": 4, "alpha": 8, "target_modules": "all-linear"})
    assert hasattr(tr.strategy.actor, "peft_config")
    history = [h for h in tr.fit(PROMPTS) if "actor/pg_loss" in h]
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in history)
    assert all(h["async/staleness_max"] <= 1 for h in history)


def test_workers_decode_in_the_trainers_autocast_dtype(tiny_path, tmp_path):
    """Under bf16 autocast the workers hold bf16 weights (the push casts the fp32 actor's) and build
    their engine with the trainer's engine settings; the actor itself stays fp32."""
    tr = trainer(tiny_path, tmp_path / "run", steps=2, autocast="bfloat16", partial_rollouts=False)
    rollout = tr.async_rollout
    assert rollout.dtype == torch.bfloat16 and rollout.engine_settings["autocast_dtype"] == torch.bfloat16
    history = [h for h in tr.fit(PROMPTS) if "actor/pg_loss" in h]
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in history)
    assert rollout.publisher.flat.dtype == torch.bfloat16 and next(tr.strategy.actor.parameters()).dtype == torch.float32


def test_on_a_gpu_machine_the_workers_wait_passively(tiny_path, tmp_path, monkeypatch):
    """Where an NVIDIA device is present the workers start with ``OMP_WAIT_POLICY=PASSIVE`` (their torch
    loads after the start), as the `verl-fast` process sets it for itself; a user's own value stays."""
    for preset, want in ((None, b"OMP_WAIT_POLICY=PASSIVE"), ("ACTIVE", b"OMP_WAIT_POLICY=ACTIVE")):
        if preset is None:
            monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        else:
            monkeypatch.setenv("OMP_WAIT_POLICY", preset)
        monkeypatch.setattr(openmp_env, "NVIDIA_MARKERS", (__file__,))  # a path that exists: "a GPU machine"
        rollout = trainer(tiny_path, tmp_path / f"run_{preset}", steps=1).async_rollout
        rollout._start()
        try:
            environ = Path(f"/proc/{rollout._procs[0].pid}/environ").read_bytes().split(b"\0")
            assert want in environ
        finally:
            rollout.close(0)
