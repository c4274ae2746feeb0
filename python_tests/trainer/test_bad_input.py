"""The faults of the third reliability round that a step, a trainer or a library call reproduces (the
command-line refusals are in python_tests/package/test_cli_errors.py, whose table lists these too):
damaged and hostile checkpoints kept and named, overwrite limited to what a run wrote, killed exports'
leftovers removed, rewards out of float32 range, a reward's sys.exit, reward and reference models that
do not fit, missing weights, file:line for late data errors, full disks and failed uploads in one line."""

import errno
import fcntl
import json
import os
import re
import struct
import zlib
from pathlib import Path

import pytest
import torch

from tiny_models import EOS, build_tokenizer, save_tiny_model, tiny_model
from verl_fast import errors
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.files import output_folder
from verl_fast import config as config_mod
from verl_fast.trainer import run_dir


def saved(tmp_path: Path, steps=(1,)) -> Path:
    """A run folder with complete checkpoints of ``steps`` (a small Linear and its optimizer)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        checkpoint.save(str(tmp_path), step, model, None, opt, {"history": []})
    return tmp_path


def test_a_damaged_checkpoint_is_set_aside_never_deleted(tmp_path, capfd):
    run = saved(tmp_path)
    step = run / "checkpoints" / "step_000001"
    shard = sorted((step / "dcp").glob("*.distcp"))[0]
    os.truncate(shard, 3)
    kept = {p.relative_to(step): p.read_bytes() for p in step.rglob("*") if p.is_file()}
    assert checkpoint.latest_valid(str(run), warn=lambda m: None) is None  # the only one, damaged
    saved(run)  # the run starts over and writes step 1 again
    aside = run / "checkpoints" / "step_000001.damaged"
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == kept
    assert checkpoint.verify(step) is None
    assert [p.name for p in checkpoint.step_dirs(str(run))] == ["step_000001"]
    assert f"{step} (not resumed: damaged) is kept as step_000001.damaged" in capfd.readouterr().err


@pytest.mark.parametrize("state, problem", [
    ({"step": 1e18, "history": []}, "step must be 2, the folder's step, got 1e+18"),
    ({"step": -5, "history": []}, "step must be 2, the folder's step, got -5"),
    ({"step": "abc", "history": []}, "step must be 2, the folder's step, got 'abc'"),
    ({"step": 2, "history": 5}, "history must be a list of metric rows, got int"),
    ([2], "must hold a JSON object, got list"),
])
def test_hostile_trainer_states_are_damaged_checkpoints(tmp_path, state, problem):
    run = saved(tmp_path, steps=(1, 2))
    step2 = run / "checkpoints" / "step_000002"
    data = json.dumps(state).encode()
    (step2 / "trainer_state.json").write_bytes(data)
    manifest = json.loads((step2 / "manifest.json").read_text())  # rewritten to match: only the state is wrong
    manifest["files"]["trainer_state.json"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (step2 / "manifest.json").write_text(json.dumps(manifest))
    messages = []
    assert checkpoint.latest_valid(str(run), warn=messages.append) == run / "checkpoints" / "step_000001"
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"checkpoint step_000002 is damaged: {step2 / 'trainer_state.json'}"), messages
    assert messages[0].endswith(f"{problem}; resuming from step_000001"), messages


def test_overwrite_keeps_a_wandb_folder_the_run_did_not_write(tmp_path):
    folder = tmp_path / "run"
    (folder / "wandb").mkdir(parents=True)
    (folder / "wandb" / "the users.txt").write_text("mine")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = config_mod.from_dict({"trainer": {"output_dir": str(folder), "overwrite": True, "resume": False,
                                            "loggers": ["console", "jsonl", "wandb"]}}).trainer
    run_dir.claim(cfg)
    run_dir.release(cfg)
    assert (folder / "wandb" / "the users.txt").read_text() == "mine" and not (folder / "metrics.jsonl").exists()
    fresh = tmp_path / "fresh"
    cfg.output_dir = str(fresh)
    run_dir.claim(cfg)  # a new folder: the run records the wandb/ its logger is about to create
    run_dir.release(cfg)
    (fresh / "wandb").mkdir()
    run_dir.claim(cfg)
    run_dir.release(cfg)
    assert not (fresh / "wandb").exists()  # the run's own: removed by overwrite


def test_a_killed_exports_temporary_folder_is_removed_by_the_next(tmp_path):
    source, out = tmp_path / "run", tmp_path / "hf"
    source.mkdir()
    stale = tmp_path / ".hf.tmp-abcd1234"  # what kill -9 during an export leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    live = tmp_path / ".hf.tmp-live5678"  # another export writing right now: it holds the lock
    live.mkdir()
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    sibling = tmp_path / "hf.tmp"
    sibling.mkdir()
    try:
        output_folder.write_folder(out, source, lambda tmp: (tmp / "config.json").write_text("{}"),
                                   overwrite=False, what="the export")
    finally:
        os.close(held)
    assert not stale.exists() and live.is_dir() and sibling.is_dir()
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


@pytest.mark.parametrize("exit_with, code", [(SystemExit(3), 3), (SystemExit(0), 1), (SystemExit("bye"), 1),
                                             (KeyboardInterrupt(), 130)])
def test_a_reward_calling_sys_exit_ends_with_its_code(exit_with, code):
    """The stop carries the exit status the CLI ends with (the trainer's ``exit_code``;
    python_tests/rewards/test_reward_faults.py runs it through fit)."""
    from verl_fast.rewards import RewardStopped, deadline

    def scorer():
        raise exit_with

    with pytest.raises(RewardStopped, match=f"exit code {code}") as stopped:
        deadline.score(scorer, "exits", 4, timeout_s=5.0)
    assert stopped.value.exit_code == code


@pytest.mark.parametrize("value", [1e308, -1e308, 3.5e38])
def test_rewards_beyond_float32_are_refused(value):
    from verl_fast.rewards import CallableReward, GuardedReward, RewardInput

    reward = GuardedReward(CallableReward(lambda solution_str: value if solution_str == "b" else 0.5), "raise",
                           timeout_s=None)
    with pytest.raises(ValueError, match=rf"reward function <lambda> returned {re.escape(f'{value:g}')} for sample 1, "
                                         r"beyond float32's range"):
        reward([RewardInput("p", "a"), RewardInput("p", "b")])
    assert reward([RewardInput("p", "a")]) == [0.5]
    assert float(torch.tensor(3.4e38, dtype=torch.float32)) < float("inf")  # the limit itself fits


def test_a_reward_model_without_pad_token_id_scores_batches(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from verl_fast.rewards import RewardInput, RewardModel

    path = save_tiny_model(tmp_path / "rm", family="llama")
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    model.config.pad_token_id = None
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = None
    rm = RewardModel(model, tokenizer, batch_size=2)
    samples = [RewardInput("What is 1 + 1?", "2"), RewardInput("hello", "a longer response than that")]
    scores = rm(samples)
    assert len(scores) == 2 and scores[1] == pytest.approx(rm(samples[1:])[0], abs=1e-5)  # padding changed nothing
    assert model.config.pad_token_id == tokenizer.convert_tokens_to_ids(EOS)


def test_a_reference_of_another_vocabulary_is_refused(tmp_path):
    from verl_fast.trainer.rl_trainer import RLTrainer

    cfg = {"rollout": {"type": "hf", "n": 2, "max_new_tokens": 4}, "algorithm": {"type": "grpo"},
           "actor": {"use_kl_loss": True},
           "trainer": {"output_dir": str(tmp_path), "device": "cpu", "progress_bar": False, "plot": False}}
    actor, ref = tiny_model("qwen2", vocab_size=512), tiny_model("qwen2", vocab_size=384)
    with pytest.raises(ValueError, match="ref_model has a vocabulary of 384 tokens and the actor 512"):
        RLTrainer(actor_model=actor, ref_model=ref, tokenizer=build_tokenizer(), config=cfg,
                  reward_fn=lambda solution_str: 0.0)


def test_weights_missing_from_the_folder_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from verl_fast.models.loading import load_causal_lm

    path = save_tiny_model(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    dropped = sorted(k for k in tensors if k.startswith("model.layers.1."))
    save_file({k: v for k, v in tensors.items() if k not in dropped}, path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"actor.model_name={path}: the weights file lacks {len(dropped)} of the "
                                         rf"model's tensors \({dropped[0]}"):
        load_causal_lm(str(path))


def test_an_overlong_prompt_names_its_line(tmp_path):
    from verl_fast.data import RLDataProcessor

    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1"}\n\n{"prompt": "' + "seven plus " * 40 + '"}\n')
    proc = RLDataProcessor(build_tokenizer(), max_prompt_length=16, overlong_prompts="error")
    with pytest.raises(ValueError, match=rf"{data}:3: a prompt has \d+ tokens, more than max_prompt_length=16"):
        proc.encode_all(proc.load(data))


def test_disk_full_names_the_path_with_human_sizes(tmp_path):
    assert [errors.human_bytes(n) for n in (0, 1023, 1536, 155_723_856, 285_097_984, 5 << 40)] == [
        "0 bytes", "1023 bytes", "1.5 KiB", "148.5 MiB", "271.9 MiB", "5.0 TiB"]
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "model.safetensors"))
    line = errors.one_line(full)
    assert line.startswith(f"no space left on the disk of {tmp_path / 'out' / 'model.safetensors'} (")
    assert line.endswith("free): free space there or write elsewhere") and errors.is_expected(full)
    message = checkpoint._disk_full_message(tmp_path, 155_723_856, 285_097_984, None)
    assert "about 148.5 MiB needed, 271.9 MiB free" in message and str(tmp_path) in message


def test_a_failed_hub_upload_is_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    import huggingface_hub

    from verl_fast.files import hub

    class Offline:
        def create_repo(self, *args, **kwargs):
            raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    folder = tmp_path / "step_000003"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(errors.UserError) as failed:
        hub.upload(folder, "org/model")
    line = errors.one_line(failed.value)
    assert line == (f"trainer.hub_model_id=org/model: the upload of {folder} failed (ConnectionError: Failed to "
                    f"resolve 'huggingface.co'); the checkpoint is kept: upload it later with `hf upload org/model "
                    f"{folder}`")
    assert errors.is_expected(failed.value) and (folder / "model.safetensors").is_file()


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1 + 4?", "reward_model": "5"}, r"row 1: reward_model must be a mapping such as \{\"ground_truth\": "
                                                r"\.\.\.\}, got '5'"),
    ({"prompt": "1 + 4?", "groundtruth": "5"}, r"row 1: groundtruth: the ground truth's key is "
                                               r"reward_model\.ground_truth"),
])
def test_ground_truth_in_the_wrong_place_is_refused_for_rows_given_in_python(row, message):
    from verl_fast.data import RLDataProcessor

    proc = RLDataProcessor(build_tokenizer(), max_prompt_length=64)
    with pytest.raises(ValueError, match=message):
        proc.encode_all([{"prompt": "2 + 2?", "reward_model": {"ground_truth": "4"}}, row])
