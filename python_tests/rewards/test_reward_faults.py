"""A user's reward that never returns, exits the process, or returns something that is not a finite
float: the run is never wedged and never ends silently. A batch past `reward_fn.timeout_s` stops the
run with a checkpoint and a message naming the reward and the sample count; SystemExit /
KeyboardInterrupt inside a reward are handled like a signal (checkpoint, message, return); the
first SIGTERM ends a run whose reward hangs; bad values are named with the reward and the sample."""

import json
import math
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config as config_mod
from verl_fast.rewards import CallableReward, GuardedReward, RewardInput, RewardStopped, RewardTimeout, deadline
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.trainer.rl_trainer import RLTrainer

PROMPTS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(1, 2), (3, 4)]]


def samples(n):
    return [RewardInput(prompt="p", response=str(i), ground_truth=str(i)) for i in range(n)]


# ---- the guard itself ------------------------------------------------------------------------------


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_batch_past_its_timeout_names_the_reward_and_the_sample_count(on_error):
    release = threading.Event()

    def slow_scorer(solution_str):
        release.wait(30)
        return 1.0

    guarded = GuardedReward(CallableReward(slow_scorer), on_error, timeout_s=0.3)
    start = time.monotonic()
    try:
        with pytest.raises(RewardTimeout, match=r"reward function slow_scorer did not return within "
                                                r"reward_fn.timeout_s=0.3 s for a batch of 4 samples"):
            guarded(samples(4))
    finally:
        release.set()
    assert time.monotonic() - start < 5  # not zeroed and retried sample by sample under on_error=zero


@pytest.mark.parametrize("timeout_s", [10.0, None])
@pytest.mark.parametrize("on_error", ["raise", "zero"])
@pytest.mark.parametrize("exit_with,shown", [(SystemExit(3), "SystemExit(3)"),
                                             (KeyboardInterrupt(), "KeyboardInterrupt")])
def test_system_exit_and_keyboard_interrupt_in_a_reward_are_a_stop_request(on_error, timeout_s, exit_with, shown):
    def exits(solution_str):
        if solution_str == "1":
            raise exit_with
        return 1.0

    with pytest.raises(RewardStopped, match=rf"reward function exits raised {re.escape(shown)} while scoring a "
                                            r"batch of 3 samples: handled as a stop request"):
        GuardedReward(CallableReward(exits), on_error, timeout_s=timeout_s)(samples(3))


def test_a_stop_request_gives_a_running_reward_a_grace_period_then_abandons_it(monkeypatch):
    monkeypatch.setattr(deadline, "STOP_GRACE_S", 0.3)
    stop, release = threading.Event(), threading.Event()

    def hangs(solution_str):
        release.wait(30)
        return 1.0

    threading.Timer(0.2, stop.set).start()
    start = time.monotonic()
    try:
        with pytest.raises(RewardStopped, match=r"a stop was requested while reward function hangs scored a batch "
                                                r"of 2 samples, and it did not return within 0.3 s"):
            GuardedReward(CallableReward(hangs), timeout_s=300)(samples(2), stop=stop)
    finally:
        release.set()
    assert time.monotonic() - start < 5

    def finishes(solution_str):
        time.sleep(0.1)  # returns within the grace period: the step completes
        return 0.5

    assert GuardedReward(CallableReward(finishes), timeout_s=300)(samples(2), stop=stop) == [0.5, 0.5]


# ---- values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad,message", [
    (float("nan"), r"returned a non-finite score nan for sample 2"),
    (float("inf"), r"returned a non-finite score inf for sample 2"),
    (-math.inf, r"returned a non-finite score -inf for sample 2"),
    (10 ** 400, "returned 1" + "0" * 39 + r"\.\.\.\(401 characters\) for sample 2, which overflows a float"),
    ("1.5", r"must return a number \(or a dict with 'score'\) for each sample, got '1.5' for sample 2"),
    ({"score": None}, r"got None for sample 2"),  # (a bare None is TRL's "not applicable": test_trl_contract)
    ([1.0], r"got \[1.0\] for sample 2"),
    ({"score": "high"}, r"got 'high' for sample 2"),
])
def test_values_that_are_not_finite_floats_name_the_reward_and_the_sample(bad, message):
    def per_sample(solution_str):
        return bad if solution_str == "2" else 1.0

    def batched(samples):
        return [1.0, 1.0, bad]

    for fn in (per_sample, batched):
        with pytest.raises((TypeError, ValueError), match=rf"reward function {fn.__name__} .*{message}"):
            GuardedReward(CallableReward(fn))(samples(3))
    zeroed = GuardedReward(CallableReward(per_sample), "zero")
    assert zeroed(samples(3)) == [1.0, 1.0, 0.0] and zeroed.last_errors == 1


def test_numbers_of_every_kind_are_scores():
    values = [True, np.float32(0.25), np.int64(2), torch.tensor(0.5), np.bool_(False), {"score": 3}, np.array([1.5])]
    got = GuardedReward(CallableReward(lambda samples: values))(samples(len(values)))
    assert got == [1.0, 0.25, 2.0, 0.5, 0.0, 3.0, 1.5]


def test_timeout_config_key():
    assert config_mod.from_dict({}).reward_fn.timeout_s == 300.0
    assert config_mod.from_dict({"reward_fn": {"timeout_s": None}}).reward_fn.timeout_s is None
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"reward_fn.timeout_s must be"):
            config_mod.from_dict({"reward_fn": {"timeout_s": bad}})
    with pytest.raises(ValueError, match=r"reward_fn.timeout_s must be a number, got 'soon'"):
        config_mod.from_dict({"reward_fn": {"timeout_s": "soon"}})


# ---- in a run ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def fit(tiny_path, output_dir, reward, **reward_fn):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "reward_fn": {"type": "gsm8k", **reward_fn}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 3, "train_batch_size": 2, "output_dir": str(output_dir), "save_freq": 1,
                       "progress_bar": False, "plot": False, "device": "cpu", "hf_export": "none"}}
    trainer = RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_path), config=cfg,
                        reward_fn=reward)
    return trainer, trainer.fit(PROMPTS)


def steps_on_disk(output_dir):
    return sorted(p.name for p in (output_dir / "checkpoints").iterdir())


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_sys_exit_in_a_reward_checkpoints_and_returns_with_a_message(tiny_path, tmp_path, capsys, on_error):
    calls = []

    def exits_in_step_2(solution_str):
        calls.append(1)
        if len(calls) == 5:  # step 2's first sample (2 prompts x 2 samples a step)
            sys.exit(3)
        return float(len(solution_str) % 2)

    trainer, history = fit(tiny_path, tmp_path, exits_in_step_2, on_error=on_error)
    out = capsys.readouterr().out
    assert trainer.stopped and [h["step"] for h in history] == [1]
    assert trainer.exit_code == 3  # what the CLI exits with: the run did not finish
    assert "step 2 stopped in its reward: reward function exits_in_step_2 raised SystemExit(3)" in out, out
    assert "stopped after step 1 of 3" in out, out
    assert steps_on_disk(tmp_path) == ["step_000001"]
    assert checkpoint.verify(tmp_path / "checkpoints" / "step_000001") is None


def test_a_reward_past_its_timeout_stops_the_run_after_a_checkpoint(tiny_path, tmp_path):
    release, calls = threading.Event(), []

    def hangs_in_step_2(solution_str):
        calls.append(1)
        if len(calls) == 5:
            release.wait(60)
        return 1.0

    try:
        with pytest.raises(RewardTimeout, match=r"reward function hangs_in_step_2 did not return within "
                                                r"reward_fn.timeout_s=0.5 s for a batch of 4 samples; the run stopped "
                                                r"after step 1, whose checkpoint is in .*checkpoints \(run again to "
                                                r"resume\)"):
            fit(tiny_path, tmp_path, hangs_in_step_2, timeout_s=0.5)
    finally:
        release.set()
    assert steps_on_disk(tmp_path) == ["step_000001"]
    assert checkpoint.verify(tmp_path / "checkpoints" / "step_000001") is None


WORKER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl_fast.rewards import deadline
    from verl_fast.trainer.rl_trainer import RLTrainer

    deadline.STOP_GRACE_S = 0.5  # the test's patience; the default gives a slow reward 5 s
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    calls = []

    def hangs_in_step_2(solution_str):
        calls.append(1)
        if len(calls) == 5:
            (out / "in_reward").touch()
            time.sleep(600)  # a reward that never returns (and does not see signals: not the main thread)
        return 1.0

    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 3, "train_batch_size": 2, "output_dir": str(out / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu", "hf_export": "none"}}
    trainer = RLTrainer(actor_model=AutoModelForCausalLM.from_pretrained(model_dir),
                        tokenizer=AutoTokenizer.from_pretrained(model_dir), config=cfg, reward_fn=hangs_in_step_2)
    history = trainer.fit([{"prompt": "What is 1 + 2?"}, {"prompt": "What is 3 + 4?"}])
    (out / "history.json").write_text(json.dumps({"steps": [h["step"] for h in history], "stopped": trainer.stopped}))
""")


def test_the_first_sigterm_ends_a_run_whose_reward_hangs(tiny_path, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tiny_path), str(tmp_path)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline_at = time.time() + 240
    while not (tmp_path / "in_reward").exists():
        assert proc.poll() is None and time.time() < deadline_at, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    try:
        out = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the first SIGTERM did not end the run: " + proc.communicate()[0][-3000:])
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM: finishing this step" in out and "step 2 stopped in its reward: a stop was requested" in out, out
    assert json.loads((tmp_path / "history.json").read_text()) == {"steps": [1], "stopped": True}
    assert steps_on_disk(tmp_path / "run") == ["step_000001"]
    assert checkpoint.verify(tmp_path / "run" / "checkpoints" / "step_000001") is None
