"""The run folder is the only place a run writes or deletes: symbolic links left at the names it
writes (`.lock`, `metrics.jsonl(.tmp)`, `reward_curve.png`, `checkpoints/`, `step_N.tmp`) are
refused or replaced, never written through; the clean-up of killed writes never reaches through a
link; and an output_dir that is empty, the current folder or one of its parents is refused unless
that folder is empty. Each refusal names the path and why."""

import json
import os
from pathlib import Path

import pytest
import torch

from verl_fast import config as config_mod
from verl_fast.metrics.logger import MetricsLogger
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.trainer import run_dir


def trainer_cfg(output_dir, **kw):
    return config_mod.from_dict({"trainer": {"output_dir": str(output_dir), **kw}}).trainer


@pytest.fixture
def outside(tmp_path):
    """A user's folder elsewhere, with a file and a folder that a run must never touch."""
    folder = tmp_path / "users_files"
    (folder / "old.tmp").mkdir(parents=True)
    (folder / "old.tmp" / "keep.txt").write_text("mine")
    (folder / "step_000001.tmp").mkdir()
    (folder / "notes.txt").write_text("precious")
    return folder


def untouched(outside: Path) -> None:
    assert (outside / "notes.txt").read_text() == "precious"
    assert (outside / "old.tmp" / "keep.txt").read_text() == "mine"
    assert (outside / "step_000001.tmp").is_dir()


def test_a_linked_lock_is_refused_and_its_target_kept(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(outside / "notes.txt")
    with pytest.raises(RuntimeError, match=rf"{run / '.lock'} \(the run's lock\) is a symbolic link \(to "
                                           rf"{outside / 'notes.txt'}\).*remove the link"):
        run_dir.claim(trainer_cfg(run))
    untouched(outside)


@pytest.mark.parametrize("name", ["metrics.jsonl", "reward_curve.png", "checkpoints", "tensorboard"])
def test_a_linked_output_is_refused_at_start_and_removed_only_as_a_link_by_overwrite(tmp_path, outside, name):
    run = tmp_path / "run"
    run.mkdir()
    target = outside / "notes.txt" if "." in name else outside
    (run / name).symlink_to(target)
    with pytest.raises(RuntimeError, match=rf"{run / name} \(trainer.output_dir's {name}\) is a symbolic link"):
        run_dir.claim(trainer_cfg(run))
    untouched(outside)
    cfg = trainer_cfg(run, overwrite=True)
    run_dir.claim(cfg)  # overwrite removes what a run writes there: here the link itself
    run_dir.release(cfg)
    assert not os.path.lexists(run / name)
    untouched(outside)


def test_metrics_files_are_replaced_never_written_through(tmp_path, outside):
    """A link at metrics.jsonl.tmp (the old fixed temporary name), at metrics.jsonl and at
    reward_curve.png: the logger writes new files under their names; the targets keep their bytes."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl.tmp").symlink_to(outside / "notes.txt")
    (run / "metrics.jsonl").symlink_to(outside / "notes.txt")
    (run / "reward_curve.png").symlink_to(outside / "notes.txt")
    logger = MetricsLogger(str(run), total_steps=2, progress_bar=False, loggers=["jsonl"])
    logger.resume([{"step": 1, "reward/mean": 0.5}])
    logger.log({"step": 2, "reward/mean": 0.75})
    logger.plot()
    logger.close()
    untouched(outside)
    assert not (run / "metrics.jsonl").is_symlink() and not (run / "reward_curve.png").is_symlink()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (run / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "metrics.jsonl.tmp").is_symlink()  # not the logger's name any more: left as it was
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(outside / "notes.txt")  # planted while the run goes on
    with pytest.raises(RuntimeError, match=r"metrics\.jsonl \(the run's file\) is a symbolic link"):
        MetricsLogger(str(run), total_steps=2, progress_bar=False, loggers=["jsonl"]).log({"step": 3})
    untouched(outside)


def test_clean_up_of_killed_writes_never_descends_through_a_link(tmp_path, outside):
    run = tmp_path / "run"
    (run / "checkpoints").parent.mkdir()
    (run / "checkpoints").symlink_to(outside)
    with pytest.raises(RuntimeError, match=r"checkpoints \(the run's checkpoints folder\) is a symbolic link"):
        checkpoint.clean_partial(str(run))
    untouched(outside)
    (run / "checkpoints").unlink()
    (run / "checkpoints" / "step_000004.tmp" / "dcp").mkdir(parents=True)
    (run / "checkpoints" / "step_000005.tmp").symlink_to(outside / "step_000001.tmp")
    (run / "checkpoints" / "notes.tmp").mkdir()  # not a checkpoint's name: the user's
    checkpoint.clean_partial(str(run))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["notes.tmp"]
    untouched(outside)


def test_checkpoint_writes_replace_links_at_their_names(tmp_path, outside):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "step_000001.tmp").symlink_to(outside / "step_000001.tmp")  # a killed write's name
    (root / "step_000001").symlink_to(outside)  # an older checkpoint's name
    path = checkpoint.save(str(tmp_path / "run"), 1, model, None, opt, {"history": []})
    assert not path.is_symlink() and checkpoint.verify(path) is None
    untouched(outside)
    assert sorted(p.name for p in outside.iterdir()) == ["notes.txt", "old.tmp", "step_000001.tmp"]
    assert not any((outside / "step_000001.tmp").iterdir())
    root.rename(tmp_path / "elsewhere")
    root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RuntimeError, match=r"checkpoints \(the run's checkpoints folder\) is a symbolic link"):
        checkpoint.save(str(tmp_path / "run"), 2, model, None, opt, {"history": []})


def test_output_dir_must_be_a_folder_of_its_own(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"trainer.output_dir must name the run's folder \(e.g. runs/<name>\), got ''"):
        config_mod.from_dict({"trainer": {"output_dir": ""}})
    with pytest.raises(ValueError, match="trainer.output_dir must name the run's folder"):
        config_mod.from_dict({"trainer": {"output_dir": "  "}})
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "metrics.jsonl").write_text("the user's own\n")
    (project / "src").mkdir()
    monkeypatch.chdir(project / "src")
    for given, which in ((".", "the current folder"), ("..", "a parent of the current folder"),
                         (str(project), "a parent of the current folder"), ("/", "a parent of the current folder")):
        if given == ".":
            (project / "src" / "main.py").write_text("print(1)\n")
        with pytest.raises(RuntimeError, match=rf"trainer.output_dir={given} is {which} .*which holds other files"):
            run_dir.claim(trainer_cfg(given, overwrite=given != "/"))  # (never risk clearing the real /)
    assert (project / "metrics.jsonl").read_text() == "the user's own\n" and (project / "checkpoints").is_dir()
    assert not os.path.lexists(project / "src" / ".lock")
    empty = project / "src" / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    cfg = trainer_cfg(".")
    run_dir.claim(cfg)  # an empty current folder may be the run's
    run_dir.release(cfg)
    monkeypatch.chdir(project / "src")
    cfg = trainer_cfg("runs/a")
    run_dir.claim(cfg)  # a folder below the current one is the normal case
    run_dir.release(cfg)
    assert (project / "src" / "runs" / "a" / ".lock").is_file()
