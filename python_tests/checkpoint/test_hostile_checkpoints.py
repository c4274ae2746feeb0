"""Crafted pickles at every entry point that unpickles a file from outside: resume, `verl-fast
export`, `verl-fast convert`, a `.pt` dataset, `load_megatron_checkpoint`, and the resume of a
Megatron-trained run. Each payload is a harmless marker-file writer (`os.system("touch ...")`)
reached the ways a data-only loader can be fooled: through a module the allowlist trusts
(`torch.distributed.checkpoint.metadata` imports os: protocol 4's STACK_GLOBAL with the name
`os.system`, or a longer dotted walk), or as a plain global. Each must be refused with an error that
names the file and the global, and the marker must never appear."""

import io
import json
import re
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import build_tokenizer, save_tiny_model
from verl_fast import load_megatron_checkpoint
from verl_fast.files import safe_load
from cli_refusal import refusal
from verl_fast.data import RLDataProcessor
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.strategies.megatron import run_checkpoint as megatron_checkpoint
from verl_fast.trainer.rl_trainer import RLTrainer

TRUSTED = "torch.distributed.checkpoint.metadata"  # on the DCP allowlist; it imports os and torch


def _text(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def payload(module: str, name: str, marker: Path, opcode: str) -> bytes:
    """A pickle calling ``module.name("touch marker")``: ``stack`` pushes both names and runs
    STACK_GLOBAL (protocol 4, each string memoized as pickle does); ``global`` writes GLOBAL under a
    protocol-4 header, which resolves dotted names too."""
    call = _text(f"touch {marker}") + b"\x85R."  # TUPLE1, REDUCE, STOP
    if opcode == "stack":
        return b"\x80\x04" + _text(module) + b"\x94" + _text(name) + b"\x94\x93" + call
    return b"\x80\x04c" + f"{module}\n{name}\n".encode() + call


# (module, name, opcode): what each pickle names, and how
TRICKS = [
    (TRUSTED, "os.system", "stack"),  # a trusted module + a dotted name into what it imports
    (TRUSTED, "torch.os.system", "stack"),  # a longer walk
    (TRUSTED, "os.system", "global"),  # the same through GLOBAL
    ("posix", "system", "stack"),  # plainly
]
IDS = ["trusted-module-dotted", "longer-walk", "global-opcode", "plain"]


def refused(path_pattern: str, module: str, name: str) -> str:
    return f"{path_pattern}: refused to unpickle the global " + re.escape(f"{module}.{name}")


def torch_file(path: Path, pickle_bytes: bytes) -> None:
    """A torch.save zip whose data.pkl is ``pickle_bytes``."""
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    original = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in original.infolist():
            data = original.read(info.filename)
            out.writestr(info.filename, pickle_bytes if info.filename.endswith("/data.pkl") else data)


def rewrite_manifest(step: Path) -> None:
    """What a careful attacker does: the manifest lists the planted file with its true size and CRC."""
    manifest = json.loads((step / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (step / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (step / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def trainer(tiny_path, output_dir, total_steps):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": total_steps, "train_batch_size": 2, "output_dir": str(output_dir),
                       "progress_bar": False, "plot": False, "device": "cpu", "hf_export": "none"}}
    return RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_path), config=cfg,
                     reward_fn=lambda solution_str: float(len(solution_str) % 2))


PROMPTS = [{"prompt": "What is 1 + 2?"}, {"prompt": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def run_with_a_checkpoint(tiny_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    trainer(tiny_path, out, 1).fit(PROMPTS)
    return out


def test_resume_and_export_refuse_a_planted_dcp_metadata(tiny_path, run_with_a_checkpoint, tmp_path, capsys):
    """The run's newest checkpoint gets a `.metadata` that names os.system through the trusted DCP
    module (the manifest rewritten to match, so verification passes): resuming and `verl-fast
    export` both refuse it, naming the file and the global."""
    import shutil

    for (module, name, opcode), case in zip(TRICKS, IDS):
        run = tmp_path / case
        shutil.copytree(run_with_a_checkpoint, run, ignore=shutil.ignore_patterns(".lock"))
        step = run / "checkpoints" / "step_000001"
        marker = tmp_path / f"ran-{case}"
        (step / "dcp" / ".metadata").write_bytes(payload(module, name, marker, opcode))
        rewrite_manifest(step)
        assert checkpoint.verify(step) is None
        with pytest.raises(ValueError, match=refused(r"dcp/\.metadata", module, name)):
            trainer(tiny_path, run, 2).fit(PROMPTS)
        assert re.search(refused(r"dcp/\.metadata", module, name),
                         refusal(["export", str(run), str(tmp_path / f"hf-{case}")], capsys))
        assert not (tmp_path / f"hf-{case}").exists()
        assert not marker.exists(), case


@pytest.mark.parametrize("module,name,opcode", TRICKS, ids=IDS)
def test_convert_and_load_megatron_checkpoint_refuse_a_torch_dist_metadata(tmp_path, module, name, opcode, capsys):
    marker = tmp_path / "ran"
    folder = tmp_path / "torch_dist"
    folder.mkdir()
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (folder / ".metadata").write_bytes(payload(module, name, marker, opcode))
    with pytest.raises(ValueError, match=refused(r"torch_dist/\.metadata", module, name)):
        load_megatron_checkpoint(folder)
    assert re.search(refused(r"torch_dist/\.metadata", module, name),
                     refusal(["convert", str(folder), str(tmp_path / "hf")], capsys))
    assert not marker.exists()


@pytest.mark.parametrize("module,name,opcode", TRICKS, ids=IDS)
def test_legacy_megatron_shards_and_pt_datasets_refuse_crafted_pickles(tmp_path, module, name, opcode, capsys):
    """torch's weights-only unpickler stops at protocol 4's opcodes without naming anything; the
    error still names the global the pickle reaches for."""
    marker = tmp_path / "ran"
    shard = tmp_path / "legacy" / "iter_0000001" / "mp_rank_00"
    shard.mkdir(parents=True)
    torch_file(shard / "model_optim_rng.pt", payload(module, name, marker, opcode))
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(ValueError, match=refused(r"mp_rank_00/model_optim_rng\.pt", module, name)):
        load_megatron_checkpoint(tmp_path / "legacy")
    assert re.search(refused(r"mp_rank_00/model_optim_rng\.pt", module, name),
                     refusal(["convert", str(tmp_path / "legacy"), str(tmp_path / "hf")], capsys))
    torch_file(tmp_path / "rows.pt", payload(module, name, marker, opcode))
    with pytest.raises(ValueError, match=refused(r"rows\.pt", module, name) + r"( \(.*\))?: a dataset"):
        RLDataProcessor(build_tokenizer()).load(tmp_path / "rows.pt")
    assert not marker.exists()


class _MegatronActor:
    """Stands in for MegatronActor: records whether megatron-core's loader would have been reached."""

    def __init__(self):
        self.loaded = False

    def export_to(self, model):
        pass


def test_megatron_run_resume_reads_its_dist_checkpoint_as_data_first(tmp_path, monkeypatch):
    """megatron-core's dist_checkpointing.load unpickles `.metadata` with no allowlist, non-tensor
    items with weights_only=False and common.pt: the trainer reads each as data only before
    handing the folder over, and a planted pickle in any of them stops the resume there."""
    import torch.distributed.checkpoint as dcp

    # megatron-core's loader, reached only after the data-only reads: records that it was
    monkeypatch.setattr(megatron_checkpoint.dist_checkpoint, "load", lambda actor, path: setattr(actor, "loaded", True))
    marker = tmp_path / "ran"
    good = tmp_path / "good" / "megatron"
    dcp.save({"w": torch.arange(4.0), "step": 3}, checkpoint_id=str(good), no_dist=True)
    torch.save({"args": None}, good / "common.pt")
    actor = _MegatronActor()
    hf = torch.nn.Linear(2, 2)
    (good.parent / checkpoint.STATE).write_text(json.dumps({"step": 3}))
    megatron_checkpoint.load(good.parent, actor, hf)
    assert actor.loaded

    def planted(where: str) -> Path:
        folder = tmp_path / where / "megatron"
        if where == "item":  # a non-tensor item of the DCP checkpoint
            dcp.save({"w": torch.arange(4.0), "evil": _RunsCode(marker)}, checkpoint_id=str(folder), no_dist=True)
        else:
            dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(folder), no_dist=True)
        if where == "metadata":
            (folder / ".metadata").write_bytes(payload(TRUSTED, "os.system", marker, "stack"))
        if where == "common":  # megatron-core's common state
            torch_file(folder / "common.pt", payload(TRUSTED, "os.system", marker, "stack"))
        else:
            torch.save({"args": None}, folder / "common.pt")
        return folder.parent

    cases = {"metadata": refused(r"megatron/\.metadata", TRUSTED, "os.system"),
             "item": r"checkpoint item evil: refused to unpickle the global (posix|os)\.system",
             "common": refused(r"megatron/common\.pt", TRUSTED, "os.system")}
    for where, message in cases.items():
        actor = _MegatronActor()
        with pytest.raises(ValueError, match=message):
            megatron_checkpoint.load(planted(where), actor, hf)
        assert not actor.loaded, where
    assert not marker.exists()


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_referenced_globals_follow_the_memo():
    """The names in refusal messages: GLOBAL's, and STACK_GLOBAL's two strings, also when they come
    back from the memo (as a pickler writes a module it names twice)."""
    twice = (b"\x80\x04" + _text("os") + b"\x94" + _text("system") + b"\x94\x93" + b"h\x00" + _text("getcwd")
             + b"\x94\x93.")  # BINGET 0: "os" again
    assert safe_load.referenced_globals(twice) == ["os.system", "os.getcwd"]
    assert safe_load.referenced_globals(b"\x80\x02cposix\nsystem\n.") == ["posix.system"]
    assert safe_load.referenced_globals(b"\x80\x04\x8c") == []  # damaged: nothing named
