"""Every command line of README.md and docs/ runs as written: the commands are read out of the pages
(fenced blocks and inline code), and each runs in a folder holding the files it names (c.yaml, the
datasets), with only paths and sizes changed (a tiny local model for the Hub names, one step, the HF
engine). The SFT / preference family runs a step; the others, whose full run needs the demo model,
GPUs or several processes, run to ``--print-config`` (the whole config resolved and checked)."""

import json
import os
import re
import shlex
from pathlib import Path

import pandas as pd
import pytest

from tiny_models import save_tiny_model
from verl_fast.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# not run here, each for its reason (the rest of the line still is, where there is one)
NOT_RUN = {"bash scripts/install.sh": "installs packages from the network",
           "pytest python_tests": "the whole test suite"}
# the commands that train a step (the rest run to --print-config)
# (examples/sft/config.yaml trains the demo model: its step is python_tests/package/test_examples.py's)
STEP = ("algorithm.type=sft", "algorithm.type=simpo", "algorithm.type=kto", "--config c.yaml --set actor.lr=1e-5")


def _clean(line: str) -> str:
    return " ".join(re.sub(r"\s+#.*$", "", line).split())


def commands():
    """(page, command) for every verl-fast / torchrun command of the pages."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for block in re.finditer(r"```[\w-]*\n(.*?)```", text, re.S):
            for line in block.group(1).replace("\\\n", " ").splitlines():
                for part in line.split("&&"):
                    part = _clean(part)
                    if re.match(r"(verl-fast |torchrun .*-m verl_fast )", part + " ") and not re.match(
                            r"verl-fast \w+: ", part):
                        out.append((page.name, part))
        for span in re.finditer(r"`(verl-fast (?:train|sft)\b[^`]*)`", text):
            command = _clean(span.group(1))
            if not re.match(r"verl-fast \w+: ", command):
                out.append((page.name, command))
    return sorted(set(out))


def synopsis(command):
    return any(mark in command for mark in ("[", "<", "..."))


COMMANDS = commands()


def test_the_pages_hold_the_commands_this_test_runs():
    names = {c for _, c in COMMANDS}
    assert any("algorithm.type=sft" in c for c in names) and any("algorithm.adv_estimator=grpo" in c for c in names)
    assert any(c.startswith("torchrun") for c in names) and len(names) >= 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The files the commands name, as the pages describe them."""
    root = tmp_path_factory.mktemp("docs_run")
    save_tiny_model(root / "tiny")
    chats = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                           {"role": "assistant", "content": f"{a + b}"}]} for a, b in ((2, 3), (4, 1), (6, 2), (1, 1))]
    pairs = [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}, {"prompt": "What is 3 + 1?", "chosen": "4",
                                                                           "rejected": "7"}] * 2
    kto = [{"prompt": "What is 2 + 2?", "completion": "4", "label": True},
           {"prompt": "What is 2 + 2?", "completion": "5", "label": False}] * 2
    for name, rows in (("my_chats.jsonl", chats), ("pairs.jsonl", pairs), ("kto.jsonl", kto)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "c.yaml").write_text(
        f"actor:\n  model_name: {root / 'tiny'}\n  micro_batch_size: 4\nrollout:\n  type: hf\n  n: 2\n"
        "  max_new_tokens: 8\nreward_fn:\n  type: reasoning_gym\nalgorithm:\n  type: grpo\ntrainer:\n"
        "  total_steps: 1\n  train_batch_size: 2\n  dataset: reasoning_gym:chain_sum\n  dataset_kwargs: {size: 8}\n"
        "  device: cpu\n  max_prompt_length: 256\n")
    gsm8k = root / "data" / "gsm8k"
    gsm8k.mkdir(parents=True)
    for split in ("train", "test"):
        pd.DataFrame([{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
                       "reward_model": {"ground_truth": "5"}}] * 4).to_parquet(gsm8k / f"{split}.parquet")
    os.symlink(ROOT / "examples", root / "examples")
    (root / "ppo_trainer.yaml").write_text(  # a file in the layout of verl's own: a defaults list, verl's keys
        "defaults:\n  - actor@actor_rollout_ref.actor: dp_actor\n  - data@data: legacy_data\n"
        "  - rollout@actor_rollout_ref.rollout: rollout\n  - _self_\n"
        f"actor_rollout_ref:\n  model:\n    path: {root / 'tiny'}\n  actor:\n    ppo_mini_batch_size: 2\n"
        "  rollout:\n    n: 2\n    name: hf\nalgorithm:\n  adv_estimator: grpo\ndata:\n  train_batch_size: 2\n")
    return root


def as_run(command, root):
    """The command's arguments for ``verl_fast.cli.main``, paths and sizes changed, and whether it trains."""
    command = re.sub(r"^torchrun .*?-m verl_fast ", "verl-fast ", command)  # one process here: its config
    args = shlex.split(os.path.expandvars(command.replace("$HOME", str(root))))[1:]
    tiny = str(root / "tiny")
    args = [re.sub(r"^((?:actor\.model_name|actor_rollout_ref\.model\.path)=).*$", lambda m: m.group(1) + tiny, a)
            for a in args]
    step = any(s in command for s in STEP)
    verl = any(a.startswith(("actor_rollout_ref.", "data.", "algorithm.adv_estimator")) for a in args)
    if not step:
        return args + ["--print-config"], False
    if verl:
        return args + ["trainer.total_training_steps=1", "data.train_batch_size=2"], True
    return args + [f"actor.model_name={tiny}", "trainer.total_steps=1", "trainer.train_batch_size=2",
                   "actor.micro_batch_size=2",
                   "rollout.type=hf", "trainer.device=cpu", f"trainer.output_dir={root}/runs/{abs(hash(command))}"], True


@pytest.mark.parametrize("page, command", COMMANDS, ids=[c[:60] for _, c in COMMANDS])
def test_doc_command_runs_as_written(page, command, folder, monkeypatch, capsys):
    if any(command.startswith(prefix) for prefix in NOT_RUN):
        pytest.skip(NOT_RUN[next(p for p in NOT_RUN if command.startswith(p))])
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", str(folder))
    if synopsis(command):  # a synopsis: every option it names is one the command takes
        parser_help = cli.build_parser().parse_args(["train", "--print-config"])
        for option in re.findall(r"--[\w-]+", command):
            assert hasattr(parser_help, option[2:].replace("-", "_")) or option == "--set", option
        return
    args, trains = as_run(command, folder)
    code = cli.main(args)
    captured = capsys.readouterr()
    assert code == 0, f"{page}: {command}\n{captured.err[-3000:]}"
    if trains:
        assert "Traceback" not in captured.err


@pytest.mark.parametrize("algorithm, dataset", [("sft", "my_chats.jsonl"), ("kto", "kto.jsonl"), ("dpo", "pairs.jsonl"),
                                                ("orpo", "pairs.jsonl"), ("simpo", "pairs.jsonl"), ("cpo", "pairs.jsonl")])
def test_the_offline_family_without_config_in_set_and_bare_forms(algorithm, dataset, folder, monkeypatch, capsys):
    """Without --config the demo's reward is not carried into an algorithm that samples nothing, and a
    refusal names the algorithm given (orpo, not dpo)."""
    monkeypatch.chdir(folder)
    for args in (["--set", f"algorithm.type={algorithm}", f"trainer.dataset={dataset}"],
                 [f"algorithm.type={algorithm}", f"trainer.dataset={dataset}"]):
        assert cli.main(["train", *args, "--print-config"]) == 0, capsys.readouterr().err
        assert "reward_fn:\n  type: auto" in capsys.readouterr().out
    if algorithm in ("dpo", "orpo", "simpo", "cpo"):  # pairs carry their ranking: a reward is refused, by name
        assert cli.main(["train", "--set", f"algorithm.type={algorithm}", "reward_fn.type=gsm8k", "--print-config"]) == 2
        assert f"algorithm.type={algorithm} is not supported with reward_fn.type=gsm8k" in capsys.readouterr().err
