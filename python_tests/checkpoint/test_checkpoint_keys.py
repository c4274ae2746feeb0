"""The checkpoint keys: ``trainer.save_total_limit`` (older checkpoints removed, never through a
link), ``trainer.resume_from``, the model card in every HF export, and ``trainer.hub_model_id``
(huggingface_hub's upload replaced by a recorder: the Hub is unreachable here)."""

import fnmatch
import json
import os

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.checkpoint import model_card
from verl_fast import config as C
from verl_fast.cli.main import main as cli_main
from verl_fast.trainer.rl_trainer import RLTrainer

PROMPTS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def trainer_for(tiny_path, output_dir, **trainer):
    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(output_dir), "progress_bar": False,
                       "plot": False, "device": "cpu", "hf_export": "none", **trainer}}
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    return RLTrainer(actor_model=model, tokenizer=tok, config=cfg,
                     reward_fn=lambda solution_str: float(len(solution_str) % 3) / 2), model


def steps(output_dir):
    return sorted(p.name for p in checkpoint.checkpoint_root(str(output_dir)).iterdir())


def test_save_total_limit_keeps_the_newest_and_never_follows_a_link(tiny_path, tmp_path):
    run, victim = tmp_path / "run", tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "keep.txt").write_text("not the run's")
    (run / "checkpoints").mkdir(parents=True)
    os.symlink(victim, run / "checkpoints" / "step_000000", target_is_directory=True)  # an old name, a link
    trainer, _ = trainer_for(tiny_path, run, total_steps=4, save_freq=1, save_total_limit=2)
    history = trainer.fit(PROMPTS)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert steps(run) == ["step_000003", "step_000004"]
    assert (victim / "keep.txt").read_text() == "not the run's"  # the link was unlinked, its target kept
    assert checkpoint.verify(run / "checkpoints" / "step_000004") is None


def test_prune_refuses_a_linked_checkpoints_folder_and_a_bad_limit(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "run" / "checkpoints")
    with pytest.raises(RuntimeError, match="is a symbolic link"):
        checkpoint.prune(str(tmp_path / "run"), 1)
    with pytest.raises(ValueError, match="save_total_limit"):
        checkpoint.prune(str(tmp_path / "run"), 0)
    with pytest.raises(ValueError, match="trainer.save_total_limit must be >= 1"):
        C.from_dict({"trainer": {"save_total_limit": 0}})


def test_resume_from_a_checkpoint_of_another_run(tiny_path, tmp_path):
    first, _ = trainer_for(tiny_path, tmp_path / "a", total_steps=2)
    first.fit(PROMPTS)
    start = tmp_path / "a" / "checkpoints" / "step_000002"
    saved = {k: v.clone() for k, v in first.actor.state_dict().items()}
    second, model = trainer_for(tiny_path, tmp_path / "b", total_steps=3, resume_from=str(start))
    history = second.fit(PROMPTS)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history[:2] == first.history  # its metrics continue the first run's
    assert steps(tmp_path / "b") == ["step_000003"]
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["step"] == 3
    # the first run moved the weights, so a run that resumes from it with nothing left to train ends on them
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).state_dict()
    assert any(not torch.equal(saved[k], base[k]) for k in saved)
    third, _ = trainer_for(tiny_path, tmp_path / "c", total_steps=2, resume_from=str(tmp_path / "a"))
    assert [h["step"] for h in third.fit(PROMPTS)] == [1, 2]  # a run folder: its newest; nothing left to train
    assert all(torch.equal(third.actor.state_dict()[k], saved[k]) for k in saved)


def test_resume_from_errors_name_the_key(tiny_path, tmp_path):
    trainer, _ = trainer_for(tiny_path, tmp_path / "b", resume_from=str(tmp_path / "missing"))
    with pytest.raises(checkpoint.CheckpointError, match="trainer.resume_from=.*missing: .*no complete checkpoint"):
        trainer.fit(PROMPTS)
    older, _ = trainer_for(tiny_path, tmp_path / "a", total_steps=1)
    older.fit(PROMPTS)
    newer, _ = trainer_for(tiny_path, tmp_path / "b", total_steps=2)
    newer.fit(PROMPTS)
    clash, _ = trainer_for(tiny_path, tmp_path / "b", total_steps=3,
                           resume_from=str(tmp_path / "a" / "checkpoints" / "step_000001"))
    with pytest.raises(checkpoint.CheckpointError, match="holds the newer checkpoint .*step_000002"):
        clash.fit(PROMPTS)
    with pytest.raises(ValueError, match="lies in trainer.output_dir, which trainer.overwrite=true clears"):
        C.from_dict({"trainer": {"output_dir": str(tmp_path / "b"), "overwrite": True,
                                 "resume_from": str(tmp_path / "b" / "checkpoints" / "step_000002")}})


def test_every_hf_export_has_a_model_card(tiny_path, tmp_path):
    trainer, _ = trainer_for(tiny_path, tmp_path / "run", total_steps=2, hf_export="final", run_name="tiny-grpo",
                             dataset="org/prompts")
    history = trainer.fit(PROMPTS)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    card = (ckpt / "README.md").read_text()
    assert checkpoint.verify(ckpt) is None  # listed in the manifest
    assert card.startswith("---\nlibrary_name: transformers\n") and "datasets:\n- org/prompts\n" in card
    assert "# tiny-grpo" in card and "Trained with verl_fast (grpo) for 2 steps" in card
    assert f"| reward/mean | {history[-1]['reward/mean']:.6g} |" in card
    assert "dataset: `org/prompts`" in card and "## Reward curve (reward/mean)" in card
    config_yaml = card.split("```yaml\n", 1)[1].split("```", 1)[0]
    import yaml

    assert yaml.safe_load(config_yaml) == trainer.cfg.to_dict()
    # an export of a checkpoint written without its HF export gets one from the trainer state
    plain, _ = trainer_for(tiny_path, tmp_path / "plain", total_steps=1, hf_export="none")
    plain.fit(PROMPTS)
    assert not (tmp_path / "plain" / "checkpoints" / "step_000001" / "README.md").exists()
    assert cli_main(["export", str(tmp_path / "plain"), str(tmp_path / "hf")]) == 0
    assert "Trained with verl_fast (grpo) for 1 steps" in (tmp_path / "hf" / "README.md").read_text()


def test_model_card_curve_and_table():
    values = [0.1 * i for i in range(45)]
    history = [{"step": i + 1, "reward/mean": v, "note": "text"} for i, v in enumerate(values)]
    card = model_card.render({"step": 45, "history": history, "config": {"actor": {"model_name": "/local/m"}}})
    rows = [line for line in card.split("## Reward curve")[1].splitlines() if line.startswith("| ") and "step" not in line]
    assert len(rows) <= model_card._CURVE_ROWS + 1 and rows[0] == "| 1 | 0 |" and rows[-1] == "| 45 | 4.4 |"
    line = model_card.sparkline(values)
    assert len(line) == 45 and line[0] == "▁" and line[-1] == "█" and list(line) == sorted(line)
    assert model_card.sparkline([2.0, 2.0]) == "▁▁" and model_card.sparkline([]) == ""
    assert "base_model" not in card and "note" not in card.split("## Final metrics")[1].split("##")[0]
    dpo = model_card.render({"step": 1, "history": [{"step": 1, "dpo/reward_margin": 0.5}], "config": {}})
    assert "## Reward curve (dpo/reward_margin)" in dpo
    assert "No step was logged." in model_card.render({"step": 0, "history": [], "config": {}})


class RecordingApi:
    """huggingface_hub.HfApi's two calls an upload makes, recorded (with the files it would send)."""

    calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, folder_path, repo_id, ignore_patterns=None, **kwargs):
        files = sorted(str(p.relative_to(folder_path)) for p in __import__("pathlib").Path(folder_path).rglob("*")
                       if p.is_file() and not any(fnmatch.fnmatch(str(p.relative_to(folder_path)), pat)
                                                  for pat in ignore_patterns or []))
        self.calls.append(("upload_folder", repo_id, {"folder_path": folder_path, "files": files, **kwargs}))


def test_hub_model_id_uploads_the_final_export(tiny_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    RecordingApi.calls = []
    trainer, _ = trainer_for(tiny_path, tmp_path / "run", total_steps=2, hf_export="final", save_freq=1,
                             hub_model_id="me/tiny-grpo", hub_private=False)
    trainer.fit(PROMPTS)
    (create, repo, kwargs), (upload, repo2, sent) = RecordingApi.calls  # once, at the end
    assert (create, repo, kwargs) == ("create_repo", "me/tiny-grpo", {"repo_type": "model", "private": False,
                                                                       "exist_ok": True})
    assert upload == "upload_folder" and repo2 == "me/tiny-grpo"
    assert sent["folder_path"] == str(tmp_path / "run" / "checkpoints" / "step_000002")
    assert "model.safetensors" in sent["files"] and "README.md" in sent["files"] and "config.json" in sent["files"]
    assert not [f for f in sent["files"] if f.startswith("dcp") or f in ("manifest.json", "trainer_state.json")]
    with pytest.raises(ValueError, match="trainer.hub_model_id uploads the final HF export"):
        C.from_dict({"trainer": {"hub_model_id": "me/x", "hf_export": "none"}})
