"""Sharded checkpoints: resumed at another world size, verified against their manifest (a damaged
latest one is named and skipped), exported as HF folders, written safely when killed or out of disk."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.cli.main import main as cli_main
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.trainer.rl_trainer import RLTrainer
from ports import free_port

HERE = Path(__file__).resolve().parents[1] / "support"  # the workers
PROMPTS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def config(output_dir, **trainer):
    return {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6},
            "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
            "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(output_dir),
                        "progress_bar": False, "plot": False, "device": "cpu", **trainer}}


def trainer_for(tiny_path, output_dir, **trainer):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    return RLTrainer(actor_model=model, tokenizer=tok, config=config(output_dir, **trainer),
                     reward_fn=lambda solution_str: float(len(solution_str) % 2)), model


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_fsdp2_checkpoint_of_two_ranks_resumes_in_one_process(tiny_path, tmp_path, backend):
    """Saved by 2 processes with an FSDP2 actor (each writing its shards; gloo on CPU, or NCCL on 2
    GPUs), restored into a plain CPU model in 1 process: the weights and every Adam moment equal the
    2-rank run's (gathered there), and training continues from them."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    port = free_port()
    worker = HERE / "checkpoint_dist_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port), str(tiny_path), str(tmp_path),
                               backend],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    ckpt = tmp_path / "checkpoints" / "step_000002"
    shards = sorted(p.name for p in (ckpt / "dcp").glob("*.distcp"))
    assert len(shards) == 2, shards  # one file per rank: nothing was gathered to write it
    assert not (ckpt / "model.safetensors").exists()  # hf_export: none
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)

    trainer, model = trainer_for(tiny_path, tmp_path, total_steps=3)
    path = checkpoint.latest_valid(str(tmp_path))
    state = checkpoint.load(path, model, trainer.strategy.optimizer)
    assert state["step"] == 2
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), reference["weights"][name]), name
        moments = trainer.strategy.optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(moments[key], reference["optim"][name][key]), (name, key)

    trainer, model = trainer_for(tiny_path, tmp_path, total_steps=3)
    history = trainer.fit(PROMPTS)  # used to fail: aten.lerp_.Scalar got mixed torch.Tensor and DTensor
    assert [h["step"] for h in history] == [1, 2, 3]
    moved = {n: p for n, p in model.named_parameters() if not torch.equal(p.detach(), reference["weights"][n])}
    assert moved, "the resumed step must train"


def test_ranks_writing_into_folders_of_their_own_are_refused_at_the_save(tiny_path, tmp_path):
    """Two ranks each given another output_dir (a local disk per node, or a path built per rank): the
    save stops on both ranks naming the file a rank could not read and the shared folder it needs,
    instead of publishing a checkpoint that every resume would find damaged."""
    port = free_port()
    worker = HERE / "checkpoint_dist_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port), str(tiny_path),
                               str(tmp_path / f"rank{r}"), "gloo"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    for out in outs:
        assert re.search(r"CheckpointError: \S+: .+ on rank 1, which checksums it: every rank must write to and "
                         r"read from the same checkpoint folder", out), out[-3000:]
    assert not list(tmp_path.glob("rank*/checkpoints/step_*[0-9]")), "nothing may be published"


def test_export_cli_writes_an_hf_folder_from_the_shards(tiny_path, tmp_path):
    trainer, model = trainer_for(tiny_path, tmp_path / "run", total_steps=1, hf_export="none")
    trainer.fit(PROMPTS)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    assert not (ckpt / "model.safetensors").exists()
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0  # the run's newest checkpoint
    assert cli_main(["export", str(ckpt), str(tmp_path / "hf_sharded"), "--max-shard-gb", "0.0001"]) == 0
    assert len(list((tmp_path / "hf_sharded").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").is_file()
    for folder in ("hf", "hf_sharded"):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / folder, dtype=torch.float32)
        want = dict(model.named_parameters())
        for name, p in reloaded.named_parameters():
            assert torch.equal(p, want[name]), (folder, name)
        AutoTokenizer.from_pretrained(tmp_path / folder)
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.export(str(tmp_path / "nothing"), str(tmp_path / "x"))


def test_final_export_of_one_process_written_from_memory_equals_the_shards(tiny_path, tmp_path):
    """hf_export: final in one process writes the export from the model's own tensors (not read back
    from dcp/): the same file contents as `verl-fast export` from the shards."""
    from safetensors.torch import load_file

    trainer, model = trainer_for(tiny_path, tmp_path / "run", total_steps=1, hf_export="final")
    trainer.fit(PROMPTS)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    assert cli_main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
    ours, theirs = load_file(ckpt / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    want = dict(model.named_parameters())
    assert all(torch.equal(v, want[k]) for k, v in ours.items())


def test_damaged_checkpoints_are_named_and_skipped_for_the_last_complete_one(tiny_path, tmp_path, capfd):
    trainer, _ = trainer_for(tiny_path, tmp_path, total_steps=3, save_freq=1)
    first = trainer.fit(PROMPTS)
    root = tmp_path / "checkpoints"
    truncated = root / "step_000003" / "model.safetensors"  # the final one holds the HF export
    os.truncate(truncated, truncated.stat().st_size // 2)
    emptied = sorted((root / "step_000002" / "dcp").glob("*.distcp"))[0]  # weights + optimizer shards
    os.truncate(emptied, 0)
    capfd.readouterr()
    trainer, model = trainer_for(tiny_path, tmp_path, total_steps=3, save_freq=1)
    history = trainer.fit(PROMPTS)
    err = capfd.readouterr().err
    assert f"{truncated} is " in err and "(truncated)" in err, err
    assert f"{emptied} is 0 bytes" in err and "(empty)" in err, err
    assert "resuming from step_000001" in err, err
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h["reward/mean"] for h in history] == [h["reward/mean"] for h in first]  # re-run from step 1
    rows = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]  # the re-run steps are logged once
    assert checkpoint.verify(root / "step_000002") is None and checkpoint.verify(root / "step_000003") is None


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 240
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)


def test_kill_9_during_a_checkpoint_write_resumes_from_the_last_complete_one(tiny_path, tmp_path):
    worker = HERE / "run_worker.py"
    proc = subprocess.Popen([sys.executable, str(worker), str(tiny_path), str(tmp_path), "3", "1", "hang_in_write"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(tmp_path / "writing", proc)
    proc.kill()  # SIGKILL, in the middle of step 2's checkpoint (shards written, no manifest yet)
    proc.wait()
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002.tmp"]
    trainer, _ = trainer_for(tiny_path, tmp_path / "run", total_steps=3, save_freq=1)  # the worker's config
    history = trainer.fit(PROMPTS)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002", "step_000003"]
    rows = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]


def _mount_tmpfs(path: Path, size: int) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(tiny_path, tmp_path, monkeypatch):
    trainer, _ = trainer_for(tiny_path, tmp_path / "measure", total_steps=1, hf_export="none")
    trainer.fit(PROMPTS)
    one = sum(p.stat().st_size for p in (tmp_path / "measure" / "checkpoints").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, int(one * 1.6) // 4096 * 4096):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        trainer, _ = trainer_for(tiny_path, disk, total_steps=3, save_freq=1, hf_export="none")
        with pytest.raises(checkpoint.CheckpointError) as e:
            trainer.fit(PROMPTS)
        message = str(e.value)
        assert e.value.__cause__ is None  # refused before writing: the estimate did not fit
        assert str(disk / "checkpoints") in message, message
        assert re.search(r"about [0-9.]+ (bytes|KiB|MiB) needed, [0-9.]+ (bytes|KiB|MiB) free", message), message
        assert "step_000001 is intact" in message, message
        assert checkpoint.verify(disk / "checkpoints" / "step_000001") is None
        assert [p.name for p in (disk / "checkpoints").iterdir()] == ["step_000001"]  # no partial write left

        # the estimate passes but the disk fills during the write: the same message, nothing left behind
        monkeypatch.setattr(checkpoint, "_local_bytes", lambda obj: 0)
        trainer, _ = trainer_for(tiny_path, disk, total_steps=3, save_freq=1, hf_export="none")
        with pytest.raises(checkpoint.CheckpointError, match="step_000001 is intact") as e:
            trainer.fit(PROMPTS)
        assert isinstance(e.value.__cause__, BaseException)
        assert [p.name for p in (disk / "checkpoints").iterdir()] == ["step_000001"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_sigterm_finishes_the_step_and_checkpoints_a_second_signal_stops_at_once(tiny_path, tmp_path):
    """Two runs side by side: one gets SIGTERM during step 2 (it finishes the step, checkpoints and
    exits 0), the other Ctrl-C twice during step 1 (it ends at once, writing nothing)."""
    worker = HERE / "run_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(tiny_path), str(tmp_path / name), "6", "0", "slow"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name in ("a", "b")]
    _wait_for(tmp_path / "b" / "in_step_1", procs[1])
    procs[1].send_signal(signal.SIGINT)
    time.sleep(0.2)
    procs[1].send_signal(signal.SIGINT)
    _wait_for(tmp_path / "a" / "in_step_2", procs[0])
    procs[0].send_signal(signal.SIGTERM)
    out_a, out_b = (p.communicate(timeout=240)[0] for p in procs)

    assert procs[0].returncode == 0, out_a[-3000:]
    assert "SIGTERM: finishing this step" in out_a
    assert json.loads((tmp_path / "a" / "history.json").read_text()) == {"steps": [1, 2], "stopped": True}
    ckpt = tmp_path / "a" / "run" / "checkpoints" / "step_000002"
    assert checkpoint.verify(ckpt) is None
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 2

    assert procs[1].returncode == -signal.SIGINT, out_b[-3000:]
    assert "SIGINT again: stopping at once" in out_b
    assert not (tmp_path / "b" / "history.json").exists()
    assert not list((tmp_path / "b" / "run").glob("checkpoints/step_*"))


def test_critic_and_optimizers_round_trip(tmp_path):
    """Actor, critic and both optimizers' moments come back exactly; a run without a critic loads a
    checkpoint that has one, and the other way round."""
    def models(seed):
        torch.manual_seed(seed)
        actor, critic = torch.nn.Linear(5, 3), torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 1))
        opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (actor, critic)]
        for m, opt in zip((actor, critic), opts):
            m(torch.randn(2, 5)).sum().backward()
            opt.step()
        return actor, critic, opts

    actor, critic, (opt, copt) = models(0)
    path = checkpoint.save(str(tmp_path), 7, actor, None, opt, {"history": []}, critic, copt)
    assert checkpoint.verify(path) is None and path.name == "step_000007"
    actor2, critic2, (opt2, copt2) = models(1)
    assert checkpoint.load(path, actor2, opt2, critic2, copt2)["step"] == 7
    for a, b, oa, ob in ((actor, actor2, opt, opt2), (critic, critic2, copt, copt2)):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(oa.state[p][key], ob.state[q][key]), key
    checkpoint.load(path, actor2, opt2)  # no critic in this run
    bare = checkpoint.save(str(tmp_path / "bare"), 1, actor, None, opt, {"history": []})
    checkpoint.load(bare, actor2, opt2, critic2, copt2)  # the critic keeps its weights


def test_partial_and_unfinished_folders_are_never_resumed(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_000003.tmp" / "dcp").mkdir(parents=True)
    (root / "step_000002").mkdir()
    checkpoint.clean_partial(str(tmp_path))
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
    # a step folder without a manifest is not complete
    assert "manifest.json is missing" in checkpoint.verify(root / "step_000002")
    shutil.rmtree(root)
    assert checkpoint.latest_valid(str(tmp_path)) is None
