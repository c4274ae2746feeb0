"""Overrides at any depth (``--set`` with several items, bare ``key=value`` arguments), config
errors as one line with exit code 2, the wandb project / run name keys, and the optional packages a
config needs, checked at start-up with the pip extra that installs them."""

import importlib.machinery
import os
import subprocess
import sys
import types

import pytest
import yaml

from verl_fast import config as C
from verl_fast import extras
from verl_fast.algos import registry
from verl_fast.cli.main import main as cli_main


def test_override_any_depth_keeps_the_other_keys():
    cfg = C.load(C.default_config_path(), ["trainer.dataset_kwargs.size=10", "trainer.dataset_kwargs.extra.deep=x"])
    kwargs = cfg.trainer.dataset_kwargs
    assert kwargs["size"] == 10 and kwargs["seed"] == 42 and kwargs["max_digits"] == 1  # the file's others stay
    assert kwargs["extra"] == {"deep": "x"}


def test_overrides_do_not_change_the_data_they_start_from():
    data = {"trainer": {"dataset_kwargs": {"size": 5}}}
    out = C.apply_overrides(data, ["trainer.dataset_kwargs.size=7", "actor.lr="])
    assert data == {"trainer": {"dataset_kwargs": {"size": 5}}}
    assert out["trainer"]["dataset_kwargs"]["size"] == 7 and out["actor"]["lr"] is None


@pytest.mark.parametrize("item, message", [
    ("actor.lr.x=1", "actor.lr is 1e-06, not a mapping"),
    ("actor=1", "must look like section.key=value"),
    ("actor..lr=1", "must look like section.key=value"),
    ("actor.lr", "must look like section.key=value"),
    ("actor.lr=[1", "not valid YAML"),
])
def test_bad_overrides_name_the_item(item, message):
    with pytest.raises(ValueError, match=message):
        C.apply_overrides({"actor": {"lr": 1e-6}}, [item])


def test_deep_override_of_an_unknown_key_is_named():
    with pytest.raises(ValueError, match="unknown key trainer.nope"):
        C.load(C.default_config_path(), ["trainer.nope.x=1"])


def _printed(capsys, argv):
    assert cli_main(["train", "--print-config", *argv]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_cli_set_takes_several_items_and_bare_assignments(capsys):
    printed = _printed(capsys, ["--set", "actor.lr=1e-5", "trainer.dataset_kwargs.size=10", "--set", "rollout.n=2",
                                "algorithm.kl_coef=0.5", "trainer.wandb_project=proj", "trainer.run_name=r1"])
    assert printed["actor"]["lr"] == 1e-5 and printed["rollout"]["n"] == 2
    assert printed["trainer"]["dataset_kwargs"]["size"] == 10 and printed["trainer"]["dataset_kwargs"]["seed"] == 42
    assert printed["algorithm"]["kl_coef"] == 0.5
    assert printed["trainer"]["wandb_project"] == "proj" and printed["trainer"]["run_name"] == "r1"
    assert _printed(capsys, [])["trainer"]["wandb_project"] == "verl_fast"  # the default


@pytest.mark.parametrize("argv, message", [
    (["actor.nope=1"], "unknown key actor.nope"),
    (["--set", "rollout.n=0"], "rollout.n must be >= 1, got 0"),
    (["stray"], "unexpected argument 'stray'"),
    (["--config", "/no/such/config.yaml"], "No such file"),
    (["trainer.hub_model_id=a/b/c"], "trainer.hub_model_id must be a Hub repository name"),
])
def test_config_errors_are_one_line_and_exit_2(capsys, argv, message):
    assert cli_main(["train", "--print-config", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("verl-fast train: config error: ") and message in err


def test_config_error_of_the_program_has_no_traceback(tmp_path):
    """The installed command's path (``python -m verl_fast``): exit status 2, one line on stderr."""
    bad = tmp_path / "c.yaml"
    bad.write_text("actor: {lr: [1, 2]}\n")
    # from tmp_path: "-m" puts the working folder first on the path, and the project's root holds the
    # unbuilt source tree, not the installed package
    run = subprocess.run([sys.executable, "-m", "verl_fast", "train", "--config", str(bad)], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and run.stderr.strip().splitlines() == [
        "verl-fast train: config error: actor.lr must be a number, got [1, 2]"]


def test_wandb_gets_the_project_and_run_name(tmp_path, monkeypatch):
    from verl_fast.metrics.logger import MetricsLogger

    calls = []

    class Run:
        def log(self, *a, **k):
            pass

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: calls.append(kwargs) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    MetricsLogger(str(tmp_path / "run"), 1, progress_bar=False, loggers=["wandb"], project="proj",
                  run_name="first").close()
    MetricsLogger(str(tmp_path / "run"), 1, progress_bar=False, loggers=["wandb"]).close()
    assert [(c["project"], c["name"]) for c in calls] == [("proj", "first"), ("verl_fast", "run")]


def test_installed_looks_without_importing():
    assert extras.installed("json") and extras.installed("os.path")
    assert not extras.installed("no_such_package_verl_fast") and not extras.installed("no_such_package_verl_fast.sub")


@pytest.mark.parametrize("overrides, module, extra, key", [
    (["trainer.plot=true"], "matplotlib", "plot", "trainer.plot=true"),
    (["trainer.loggers=[jsonl, wandb]"], "wandb", "wandb", "trainer.loggers has wandb"),
    (["trainer.loggers=[tensorboard]"], "tensorboard", "tensorboard", "trainer.loggers has tensorboard"),
    (["rollout.type=vllm"], "vllm", "vllm", "rollout.type=vllm"),
    (["actor.strategy=megatron", "actor.autocast=none"], "megatron.core", "megatron", "actor.strategy=megatron"),
    ([], "reasoning_gym", "demo", "reward_fn.type=reasoning_gym"),
    (["rollout.multi_turn={environment: verl_fast.agents.verifiers_env:VerifiersEnvironment}"], "verifiers",
     "verifiers", "rollout.multi_turn.environment=verl_fast.agents.verifiers_env:VerifiersEnvironment"),
])
def test_a_missing_optional_package_is_named_with_its_extra(monkeypatch, overrides, module, extra, key):
    cfg = C.load(C.default_config_path(), overrides)
    monkeypatch.setattr(extras, "installed", lambda m: m != module)
    with pytest.raises(ImportError) as e:
        extras.check(cfg)
    assert f"{key}" in str(e.value) and f"pip install 'verl_fast[{extra}]'" in str(e.value)
    monkeypatch.setattr(extras, "installed", lambda m: True)
    extras.check(cfg)


def test_packages_not_asked_for_are_not_needed(monkeypatch):
    monkeypatch.setattr(extras, "installed", lambda m: False)
    cfg = C.from_dict({"algorithm": {"type": "dpo"}, "reward_fn": {"type": "pairwise_ranking"},
                       "rollout": {"type": "vllm"}, "trainer": {"plot": False, "dataset": "pairs.jsonl"}})
    offline = not registry.spec(cfg).samples  # dpo generates nothing: no engine, no reward's package
    assert offline and extras.missing(cfg, generates=False) == []
    assert extras.missing(cfg) == ["rollout.type=vllm, which needs the vllm package: pip install vllm (or pip install "
                                   "'verl_fast[vllm]')"]
    cfg.trainer.plot, cfg.critic.strategy = True, "megatron"  # a critic trains with ppo only
    assert extras.missing(cfg, generates=False) == ["trainer.plot=true (the reward-curve PNG), which needs the matplotlib package: "
                                   "pip install matplotlib (or pip install 'verl_fast[plot]')"]


@pytest.mark.parametrize("algorithm", ["ppo", "dpo", "grpo"])
def test_megatron_core_is_asked_for_by_the_actor_whatever_the_algorithm(monkeypatch, algorithm):
    """A Megatron critic is refused beside any other actor, so the actor's key is the one that needs
    megatron-core, with or without a critic trained (no algorithm's name is asked)."""
    with pytest.raises(ValueError, match="critic.strategy=megatron is not supported with actor.strategy=auto"):
        C.from_dict({"algorithm": {"type": algorithm}, "critic": {"strategy": "megatron"}})
    cfg = C.from_dict({"algorithm": {"type": algorithm}, "actor": {"strategy": "megatron", "autocast": "none"},
                       "critic": {"strategy": "megatron"}, "trainer": {"plot": False}})
    monkeypatch.setattr(extras, "installed", lambda m: m != "megatron.core")
    assert extras.missing(cfg, generates=False) == ["actor.strategy=megatron, which needs the megatron-core package: "
                                                    "pip install megatron-core (or pip install 'verl_fast[megatron]')"]


def test_cli_refuses_a_missing_extra_before_training(tmp_path, monkeypatch, capsys):
    """Before the output folder, the dataset or any model is touched: nothing written."""
    monkeypatch.setattr(extras, "installed", lambda m: m != "matplotlib")
    out = tmp_path / "run"
    assert cli_main(["train", f"trainer.output_dir={out}", "trainer.plot=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'verl_fast[plot]'" in err and "trainer.plot=false" not in err
    assert not out.exists()


def test_fit_refuses_plot_without_matplotlib_before_training(tmp_path, monkeypatch):
    """The Python API checks the package of its own reward-curve PNG before the first step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_models import save_tiny_model
    from verl_fast.trainer.rl_trainer import RLTrainer

    path = save_tiny_model(tmp_path / "m", family="qwen2", num_layers=1)
    trainer = RLTrainer(actor_model=AutoModelForCausalLM.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path),
                        reward_fn=lambda solution_str: 0.0, config={
                            "rollout": {"type": "hf", "n": 2, "max_new_tokens": 2},
                            "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                                        "progress_bar": False, "device": "cpu"}})
    monkeypatch.setattr(extras, "installed", lambda m: m != "matplotlib")
    with pytest.raises(ImportError, match=r"trainer.plot=true .* pip install 'verl_fast\[plot\]'"):
        trainer.fit([{"prompt": "1 + 1?"}, {"prompt": "2 + 2?"}])
    assert trainer.step == 0 and not (tmp_path / "run").exists()
