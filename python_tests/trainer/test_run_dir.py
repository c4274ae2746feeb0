"""A run's folder: one writer at a time, an older run is resumed, refused or cleared, and what can
fail cheaply fails before any model loads."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from verl_fast import config as config_mod
from cli_refusal import refusal
from verl_fast.trainer import run_dir


def cfg_for(tmp_path, **trainer):
    trainer.setdefault("output_dir", str(tmp_path / "run"))
    return config_mod.from_dict({"trainer": trainer})


def test_second_writer_is_refused_with_the_owner_pid(tmp_path):
    cfg = cfg_for(tmp_path)
    run_dir.claim(cfg.trainer)
    try:
        run_dir.claim(cfg.trainer)  # the same process (CLI, then fit) may take it again
        run_dir.release(cfg.trainer)
        other = textwrap.dedent(f"""
            from verl_fast import config
            from verl_fast.trainer import catalog
            from verl_fast.trainer import run_dir
            catalog.register()
            run_dir.claim(config.from_dict({{"trainer": {{"output_dir": {str(tmp_path / 'run')!r}}}}}).trainer)
        """)
        done = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)  # not the checkout, whose unbuilt verl_fast/ would shadow the package
        assert done.returncode != 0
        assert f"is in use by another run (PID {os.getpid()})" in done.stderr, done.stderr[-2000:]
    finally:
        run_dir.release(cfg.trainer)
    run_dir.claim(cfg.trainer)  # released: free again
    run_dir.release(cfg.trainer)


def test_an_older_run_is_refused_without_resume_and_cleared_with_overwrite(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints" / "step_000002").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "notes.txt").write_text("the user's own file")
    with pytest.raises(RuntimeError, match=r"holds an older run \(checkpoints, metrics.jsonl\).*overwrite=true"):
        run_dir.claim(cfg_for(tmp_path, resume=False).trainer)
    assert (folder / "checkpoints" / "step_000002").is_dir()
    run_dir.claim(cfg_for(tmp_path, resume=True).trainer)  # resume continues it: nothing removed
    run_dir.release(cfg_for(tmp_path).trainer)
    assert (folder / "metrics.jsonl").exists()
    cfg = cfg_for(tmp_path, resume=False, overwrite=True)
    run_dir.claim(cfg.trainer)
    run_dir.release(cfg.trainer)
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "notes.txt"]  # only what a run writes went


def test_precheck_names_the_busy_port_the_bad_folder_and_the_dataset(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"trainer.metrics_port={port} on 127.0.0.1 is not free"):
            run_dir.precheck(cfg_for(tmp_path, dataset=str(data), metrics_port=port))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match=f"trainer.output_dir={blocker / 'run'} is not writable"):
        run_dir.precheck(cfg_for(tmp_path, dataset=str(data), output_dir=str(blocker / "run")))
    with pytest.raises(FileNotFoundError, match="missing.parquet not found"):
        run_dir.precheck(cfg_for(tmp_path, dataset=str(tmp_path / "missing.parquet")))
    with pytest.raises(ImportError, match="trainer.loggers has wandb, which needs the wandb package: pip install wandb"):
        run_dir.precheck(cfg_for(tmp_path, dataset=str(data), loggers=["jsonl", "wandb"]))
    cfg = cfg_for(tmp_path, dataset=str(data))
    assert run_dir.precheck(cfg) == [{"prompt": "1 + 1?", "answer": "2"}]
    run_dir.release(cfg.trainer)


def test_train_cli_fails_on_the_port_before_loading_a_model(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1 + 1?"}\n')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model does not exist: had it been loaded first, the error would name it instead
        assert f"metrics_port={port}" in refusal(
            ["train", "--dataset_path", str(data), "--metrics_port", str(port), "--output_dir", str(tmp_path / "run"),
             "--set", f"actor.model_name={tmp_path / 'no_model'}", "--set", "rollout.type=hf"], capsys)


def test_loggers_config_names_the_bad_entry():
    with pytest.raises(ValueError, match=r"trainer.loggers\[1\] must be one of"):
        config_mod.from_dict({"trainer": {"loggers": ["jsonl", "neptune"]}})
    with pytest.raises(ValueError, match="trainer.loggers must be a list"):
        config_mod.from_dict({"trainer": {"loggers": "jsonl"}})
