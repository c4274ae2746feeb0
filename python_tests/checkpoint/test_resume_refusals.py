"""Resuming a checkpoint that does not fit the run (another shape, another model, another optimizer)
is one short line naming the cause, not DCP's flattened traceback; an export onto a full disk names
the folder it was writing."""

import errno

import pytest
import torch

from verl_fast import errors
from verl_fast.checkpoint import sharded as checkpoint


@pytest.fixture
def saved(tmp_path):
    model = torch.nn.Linear(2, 2)
    return checkpoint.save(str(tmp_path / "run"), 1, model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                           {"history": []})


def _adamw(model):
    return torch.optim.AdamW(model.parameters())


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("model, optimizer, cause", [
    (lambda: torch.nn.Linear(2, 3), _sgd,
     "Size mismatch between saved torch.Size([2, 2]) and current: torch.Size([3, 2]) for actor.weight"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)), _sgd, "Missing key in checkpoint state_dict: actor.0.weight"),
    (lambda: torch.nn.Linear(2, 2), _adamw, "Missing key in checkpoint state_dict: actor_optim.state.weight.step"),
], ids=["shape", "model", "optimizer"])
def test_resume_refusals_are_short_and_name_the_cause(saved, model, optimizer, cause):
    m = model()
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.load(saved, m, optimizer(m))
    line = errors.one_line(refused.value)
    assert errors.is_expected(refused.value)
    assert line.startswith(f"checkpoint {saved} does not fit this run's models: {cause}"), line
    assert "Traceback" not in line and "FrameSummary" not in line and len(line) < 400, line


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("Error while serializing: IoError(No space left on device)")],
                         ids=["oserror_without_path", "safetensors_error"])
def test_an_export_onto_a_full_disk_names_the_folder(saved, tmp_path, monkeypatch, failure):
    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(checkpoint, "_write_safetensors", full)
    out = tmp_path / "export"
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.export(str(saved), str(out))
    line = errors.one_line(refused.value)
    assert errors.is_expected(refused.value)
    assert line.startswith(f"no space left on the disk of {out} (") and "free) for the export of" in line, line
    assert not out.exists()
