"""A checkpoint's manifest checked before a resume trusts it: any malformed manifest or a file it does
not vouch for makes the checkpoint damaged ("checkpoint step_N is damaged: ...; resuming from
step_M"), and verification reads only regular files inside the checkpoint folder (a manifest naming
/dev/zero, `..`, a symbolic link out or a FIFO must not make it read forever or elsewhere)."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from verl_fast.checkpoint import sharded as checkpoint


@pytest.fixture
def run(tmp_path):
    """A run folder with complete checkpoints of steps 1 and 2 (a small model and its optimizer)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    for step in (1, 2):
        checkpoint.save(str(tmp_path), step, model, None, opt, {"history": []})
    return tmp_path


def step2(run: Path) -> Path:
    return run / "checkpoints" / "step_000002"


def edit_manifest(run: Path, change) -> None:
    path = step2(run) / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def resumed_from(run: Path):
    """What a resume picks, and the messages it printed; verification must not hang."""
    messages, result = [], []
    worker = threading.Thread(target=lambda: result.append(checkpoint.latest_valid(str(run), warn=messages.append)),
                              daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "verification hung"
    return result[0], messages


def expect_fallback(run: Path, problem: str) -> None:
    path, messages = resumed_from(run)
    assert path == run / "checkpoints" / "step_000001", messages
    assert len(messages) == 1, messages
    assert messages[0].startswith("checkpoint step_000002 is damaged: "), messages
    assert messages[0].endswith("; resuming from step_000001"), messages
    assert problem in messages[0], messages


def _distcp(run: Path) -> str:
    return next(n for n in json.loads((step2(run) / "manifest.json").read_text())["files"] if n.endswith(".distcp"))


def test_malformed_manifests_are_damaged_checkpoints(run):
    (step2(run) / "manifest.json").write_text('{"step": 2, "files": ')
    expect_fallback(run, "manifest.json is not readable JSON")
    (step2(run) / "manifest.json").write_text('[1, 2]')
    expect_fallback(run, "'files' must map each file to its size and CRC-32, got NoneType")


def test_files_as_a_list_and_entries_of_the_wrong_kind(run):
    original = (step2(run) / "manifest.json").read_text()
    edit_manifest(run, lambda m: m.update(files=list(m["files"])))
    expect_fallback(run, "'files' must map each file to its size and CRC-32, got list")
    (step2(run) / "manifest.json").write_text(original)
    edit_manifest(run, lambda m: m["files"].update({"trainer_state.json": 7}))
    expect_fallback(run, 'the entry of trainer_state.json must be {"bytes": size, "crc32": checksum}, got 7')
    (step2(run) / "manifest.json").write_text(original)
    edit_manifest(run, lambda m: m["files"]["trainer_state.json"].update(bytes=True))
    expect_fallback(run, "the entry of trainer_state.json must be")


def test_an_empty_manifest_and_an_unlisted_damaged_file(run):
    original = (step2(run) / "manifest.json").read_text()
    os.remove(step2(run) / "dcp" / ".metadata")
    edit_manifest(run, lambda m: m.update(files={}))
    expect_fallback(run, "manifest.json does not list trainer_state.json")
    (step2(run) / "manifest.json").write_text(original)
    expect_fallback(run, "dcp/.metadata is missing (the manifest lists it)")

    (step2(run) / "dcp" / ".metadata").write_bytes((run / "checkpoints" / "step_000001" / "dcp" / ".metadata")
                                                 .read_bytes())
    shard = _distcp(run)
    edit_manifest(run, lambda m: m["files"].pop(shard))  # the manifest no longer vouches for the shard...
    os.truncate(step2(run) / shard, 3)  # ...which is damaged
    expect_fallback(run, f"{shard} is not in the manifest (its contents are unchecked)")


@pytest.mark.parametrize("name", ["/dev/zero", "../../../../../../../../dev/zero", "dcp/../trainer_state.json", "",
                                  "./trainer_state.json"])
def test_names_outside_the_folder_are_never_read(run, name):
    edit_manifest(run, lambda m: m["files"].update({name: {"bytes": 1 << 40, "crc32": 0}}))
    expect_fallback(run, f"lists {name!r}, which is not a path inside the checkpoint folder")


def test_links_fifos_and_devices_inside_are_never_read(run, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "secret").write_text("x")
    for make, problem in [(lambda p: p.symlink_to("/dev/zero"), "is a symbolic link (to /dev/zero)"),
                          (lambda p: p.symlink_to(elsewhere / "secret"), "is a symbolic link"),
                          (lambda p: os.mkfifo(p), "is not a regular file (a device, FIFO or socket)")]:
        planted = step2(run) / "dcp" / "extra"
        make(planted)
        edit_manifest(run, lambda m: m["files"].update({"dcp/extra": {"bytes": 1, "crc32": 0}}))
        expect_fallback(run, f"{planted} {problem}")
        planted.unlink()
    try:
        os.mknod(step2(run) / "zero", 0o600 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's
    except PermissionError:
        return  # not root here: the FIFO above stands for every non-regular file
    edit_manifest(run, lambda m: m["files"].update({"zero": {"bytes": 1, "crc32": 0}}))
    expect_fallback(run, "zero is not a regular file")


def test_a_linked_checkpoint_folder_or_dcp_folder_is_damaged(run, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    real = step2(run).rename(elsewhere / "step_000002")
    step2(run).symlink_to(real)
    expect_fallback(run, f"{step2(run)} is a symbolic link (to {real})")
    step2(run).unlink()
    real.rename(step2(run))
    (step2(run) / "dcp").rename(elsewhere / "dcp")
    (step2(run) / "dcp").symlink_to(elsewhere / "dcp")
    expect_fallback(run, "dcp is a symbolic link")


def test_no_complete_checkpoint_left_says_so(run):
    for step in ("step_000001", "step_000002"):
        (run / "checkpoints" / step / "manifest.json").write_text("[]")
    path, messages = resumed_from(run)
    assert path is None and len(messages) == 2
    assert all("no complete checkpoint is left" in m and "starting from the initial weights" in m for m in messages)
