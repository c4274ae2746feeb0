"""Where `verl-fast export` and `verl-fast convert` may write: never the run (or checkpoint) itself or a
folder inside it, a folder holding files only with --overwrite (which replaces only the files the
command writes), always under a unique temporary name that is then renamed, and never a sibling the
command did not create (a user's `DIR.tmp`)."""

import os
import re

import pytest
import torch
from safetensors.torch import load_file

from reshard_refs import ref_megatron
from tiny_models import tiny_model
from cli_refusal import refusal
from verl_fast.cli.main import main as cli_main
from verl_fast.ops.reshard.megatron import shard_prefix
from verl_fast.checkpoint import sharded as checkpoint


@pytest.fixture
def run(tmp_path):
    """A run folder with one complete checkpoint of a small model, and a metrics file."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    checkpoint.save(str(tmp_path / "run"), 1, model, None, torch.optim.AdamW(model.parameters()), {"history": []})
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    return tmp_path / "run", {k: v.detach() for k, v in model.state_dict().items()}


def intact(run) -> None:
    assert checkpoint.verify(run / "checkpoints" / "step_000001") is None
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_the_run_itself_or_a_folder_inside_it_is_refused(run, capsys):
    folder, _ = run
    assert re.search(rf"{folder} is the source {folder}: the export goes to a folder of its own", refusal(["export", str(folder), str(folder)], capsys))
    assert re.search(rf"{folder / 'hf'} is inside the source {folder}", refusal(["export", str(folder), str(folder / "hf"), "--overwrite"], capsys))
    step = folder / "checkpoints" / "step_000001"
    assert re.search(r"is the source|is inside the source", refusal(["export", str(step), str(step), "--overwrite"], capsys))
    intact(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_a_folder_holding_files_needs_overwrite_which_replaces_only_the_exports_files(run, tmp_path, capsys):
    folder, weights = run
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    (out / "model-00001-of-00002.safetensors").write_text("an older export's shard")
    (out / "model.safetensors").write_text("an older export")
    assert re.search(rf"{out} is not empty: pass --overwrite to replace the files the export "
                                         r"writes there \(other files stay\)", refusal(["export", str(folder), str(out)], capsys))
    assert (out / "model.safetensors").read_text() == "an older export"
    assert cli_main(["export", str(folder), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors", "notes.txt"]  # + its card
    assert (out / "notes.txt").read_text() == "the user's"
    got = load_file(out / "model.safetensors")
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in got)
    (tmp_path / "file").write_text("x")
    assert re.search(r"file exists and is not a folder", refusal(["export", str(folder), str(tmp_path / "file"), "--overwrite"], capsys))
    intact(folder)


def test_temporary_names_are_unique_and_siblings_untouched(run, tmp_path, monkeypatch, capsys):
    folder, _ = run
    sibling = tmp_path / "hf.tmp"
    sibling.mkdir()
    (sibling / "mine.txt").write_text("a user's folder that happens to be called hf.tmp")
    (tmp_path / "empty").mkdir()
    assert cli_main(["export", str(folder), str(tmp_path / "hf")]) == 0
    assert cli_main(["export", str(folder), str(tmp_path / "empty")]) == 0  # an empty folder is replaced whole
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert (sibling / "mine.txt").is_file()

    def fails(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(checkpoint, "_write_safetensors", fails)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert re.search("disk gone", refusal(["export", str(folder), str(tmp_path / "hf2")], capsys))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # its temporary folder went, nothing else
    assert (sibling / "mine.txt").is_file()


def test_convert_follows_the_same_rules(tmp_path, capsys):
    model = tiny_model("qwen2")
    root = tmp_path / "ckpt"
    it = root / "iter_0000001"
    for (t, p), state in ref_megatron(model.state_dict(), model.config, 1, 1, 512).items():
        os.makedirs(it / shard_prefix(t, p, 1))
        torch.save({"model": state, "args": None}, it / shard_prefix(t, p, 1) / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    model.config.save_pretrained(tmp_path / "cfg")
    convert = ["convert", str(root), "--config", str(tmp_path / "cfg")]
    assert re.search(rf"{root / 'hf'} is inside the source {root}", refusal(convert[:2] + [str(root / "hf")] + convert[2:], capsys))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    (tmp_path / "hf.tmp-1").mkdir()  # the old temporary name's pattern
    assert re.search(rf"{out} is not empty: pass --overwrite", refusal(convert[:2] + [str(out)] + convert[2:], capsys))
    assert cli_main(convert[:2] + [str(out)] + convert[2:] + ["--overwrite"]) == 0
    assert {"config.json", "model.safetensors", "notes.txt"} <= {p.name for p in out.iterdir()}
    assert (tmp_path / "hf.tmp-1").is_dir()
