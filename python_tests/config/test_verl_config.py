"""verl's configuration tree read through verl_keys' table: units, notes, did-you-mean, every problem
at once, interpolations, the whole ppo_trainer.yaml, and the docs' table generated from the same table."""

import re
from pathlib import Path

import pytest
import yaml

from verl_fast.config import LoraConfig, verl_config
from verl_fast.config import verl_keys
from verl_fast.config.verl_config import EXACT, NATIVE, ConfigProblems

HERE = Path(__file__).parent
DOCS = HERE.parent.parent / "docs" / "verl_and_trl.md"


def load(*overrides, path=None):
    return verl_config.load(path, list(overrides))


def test_every_mapped_entry_names_keys_of_ours_and_no_key_twice():
    for entry in verl_keys.KEYS:
        assert all(o in NATIVE for o in entry.ours), entry.verl
        assert entry.how and "\n" not in entry.how, entry.verl
    names = [k.verl for k in verl_keys.KEYS]
    assert len(names) == len(set(names))


def test_docs_table_is_the_table():
    text = DOCS.read_text()
    for tree in ("ppo", "sft"):
        assert verl_config.markdown(tree) in text, \
            f"docs/verl_and_trl.md: regenerate with python -m verl_fast.config.verl_config --markdown {tree}"


def test_mini_batch_counts_prompts_times_n_per_rank(monkeypatch):
    cfg, _ = load("actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4")
    assert cfg.actor.ppo_mini_batch_size == 32  # 8 prompts x 4 samples, one process
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg, _ = load("actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
                  "actor_rollout_ref.actor.ppo_micro_batch_size=16")
    assert cfg.actor.ppo_mini_batch_size == 8 and cfg.actor.micro_batch_size == 4  # per rank
    with pytest.raises(ConfigProblems, match="must divide over the 4 processes"):
        load("actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.n=1")


def test_verl_default_n_is_one_when_not_given():
    cfg, notes = load("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    assert cfg.rollout.n == 1 and cfg.actor.ppo_mini_batch_size == 8
    assert any(n.startswith("verl's defaults applied") and "actor_rollout_ref.rollout.n=1" in n for n in notes)


def test_units_and_names():
    cfg, _ = load("algorithm.adv_estimator=gae", "critic.model.path=m", "actor_rollout_ref.actor.optim.lr=3e-6",
                  "trainer.total_epochs=15", "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.logger=console",
                  "actor_rollout_ref.rollout.name=vllm", "data.truncation=left", "trainer.resume_mode=disable",
                  "actor_rollout_ref.actor.optim.lr_warmup_steps=-1", "algorithm.kl_ctrl.kl_coef=0.01",
                  "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
                  "actor_rollout_ref.rollout.val_kwargs.temperature=0.7")
    assert cfg.algorithm.type == "ppo" and cfg.critic.model_name == "m" and cfg.actor.lr == pytest.approx(3e-6)
    assert cfg.trainer.num_epochs == 15 and cfg.trainer.save_freq == -1 and cfg.trainer.val_freq == -1  # never
    assert cfg.trainer.loggers == ["console", "jsonl"] and cfg.rollout.type == "vllm"
    assert cfg.trainer.overlong_prompts == "truncate_left" and cfg.trainer.resume is False
    assert cfg.actor.warmup_steps is None and cfg.algorithm.kl_coef == pytest.approx(0.01)
    assert cfg.actor.lora == LoraConfig(r=8, alpha=16, target_modules="all-linear")
    assert cfg.trainer.val_temperature == 0.0  # do_sample=false: greedy, whatever the temperature


def test_grpo_without_std_is_drgrpo():
    cfg, _ = load("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False",
                  "actor_rollout_ref.rollout.n=4")
    assert cfg.algorithm.type == "drgrpo"


def test_every_problem_at_once_one_line_each_with_did_you_mean():
    with pytest.raises(ConfigProblems) as e:
        load("actor_rollout_ref.actor.ppo_mini_batchsize=4", "trainer.total_epoch=3", "data.train_fles=x.parquet",
             "actor_rollout_ref.rollout.name=sglang", "algorithm.adv_estimator=opo", "actor.lr=fast",
             "trainer.logger=[console,mlflow]")
    lines = e.value.lines
    assert len(lines) == 7 and all("\n" not in line for line in lines)
    assert "unknown key actor_rollout_ref.actor.ppo_mini_batchsize; did you mean " \
           "actor_rollout_ref.actor.ppo_mini_batch_size?" in lines
    assert "unknown key trainer.total_epoch; did you mean trainer.total_epochs?" in lines
    assert "unknown key data.train_fles; did you mean data.train_files?" in lines
    assert any("rollout.name=sglang is not available here; one of " in line for line in lines)
    assert any("adv_estimator=opo is not available here" in line for line in lines)
    assert "actor.lr must be a number, got 'fast'" in lines
    assert any("mlflow, which verl_fast does not log to" in line for line in lines)


def test_cli_prints_every_problem_and_exits_2(tmp_path, capsys, monkeypatch):
    from verl_fast.cli import main as cli

    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", "actor_rollout_ref.actor.ppo_mini_batchsize=4", "trainer.total_epoch=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "verl-fast train: config error: unknown key actor_rollout_ref.actor.ppo_mini_batchsize; did you mean "
        "actor_rollout_ref.actor.ppo_mini_batch_size?",
        "verl-fast train: config error: unknown key trainer.total_epoch; did you mean trainer.total_epochs?"]


def test_noted_keys_one_line_each_and_refused_values():
    _, notes = load("trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0",
                    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=true", "global_profiler.tool=nsys")
    assert "trainer.n_gpus_per_node: torchrun --nproc_per_node decides (no meaning here; accepted)" in notes
    subtree = [n for n in notes if n.startswith("actor_rollout_ref.actor.fsdp_config.*")]
    assert len(subtree) == 1  # one note for the subtree, however many of its keys are given
    assert any(n.startswith("global_profiler.*") for n in notes)
    for bad, match in (("trainer.critic_warmup=2", "critic_warmup=2 is not available here"),
                       ("algorithm.kl_ctrl.type=adaptive", "kl_ctrl.type=adaptive is not available here"),
                       ("actor_rollout_ref.actor.optim.betas=[0.9,0.95]", "betas are \\(0.9, 0.999\\) here"),
                       ("data.truncation=middle", "data.truncation=middle is not available here")):
        with pytest.raises(ConfigProblems, match=match):
            load(bad)


def test_command_line_wins_over_the_file_in_either_layout(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor: {lr: 1.0e-5}\ndata: {train_batch_size: 8}\n")
    cfg, _ = load("actor_rollout_ref.actor.optim.lr=2e-6", "trainer.train_batch_size=4", path=path)
    assert cfg.actor.lr == pytest.approx(2e-6) and cfg.trainer.train_batch_size == 4
    path.write_text("actor: {lr: 1.0e-5}\nactor_rollout_ref: {actor: {optim: {lr: 2.0e-6}}}\n")
    with pytest.raises(ConfigProblems, match=r"actor.lr is set twice: actor.lr=1e-05 and "
                                             r"actor_rollout_ref.actor.optim.lr=2e-06; keep one"):
        load(path=path)


def test_hydra_plus_and_interpolations(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"max_response_length": 12, "train_batch_size": 6},
        "actor_rollout_ref": {"rollout": {"response_length": "${oc.select:data.max_response_length,512}",
                                          "prompt_length": "${oc.select:data.no_such_key,100}"}},
        "trainer": {"project_name": "p", "experiment_name": "e",
                    "default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}"}}))
    cfg, _ = load("+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                  "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4", path=path)
    assert cfg.rollout.max_new_tokens == 12 and cfg.trainer.max_prompt_length == 100
    assert cfg.trainer.output_dir == "checkpoints/p/e" and cfg.algorithm.overlong_buffer == 4


def test_verl_ppo_trainer_yaml_loads_as_written():
    """verl's whole ppo_trainer.yaml (defaults flattened): every key mapped or noted, none unknown."""
    path = HERE / "verl_examples" / "ppo_trainer.yaml"
    cfg, notes = load("actor_rollout_ref.rollout.name=hf", "trainer.logger=[console]", "trainer.device=cpu",
                      path=path)
    assert cfg.algorithm.type == "ppo" and cfg.trainer.train_batch_size == 1024
    assert cfg.actor.ppo_mini_batch_size == 256  # 256 prompts x n=1, one process
    assert cfg.actor.model_name == "~/models/deepseek-llm-7b-chat" and cfg.trainer.num_epochs == 30
    assert cfg.trainer.output_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.reward_fn.type == "auto"
    assert all(re.match(r"^[\w.*]+: ", n) for n in notes) and len(notes) == len(set(notes))


def test_mixed_sections_native_and_verl():
    cfg, _ = verl_config.from_dict({"actor": {"lr": 1e-5}, "reward_fn": [{"type": "gsm8k"}],
                                    "trainer": {"total_epochs": 2}})
    assert cfg.actor.lr == pytest.approx(1e-5) and cfg.trainer.num_epochs == 2
    assert cfg.reward_fn.type == "weighted"


def test_custom_reward_function_and_reward_model():
    cfg, _ = load("custom_reward_function.path=/x/my_reward.py", "custom_reward_function.name=score")
    assert (cfg.reward_fn.type, cfg.reward_fn.path) == ("callable", "/x/my_reward.py:score")
    cfg, _ = load("reward_model.enable=True", "reward_model.model.path=org/rm")
    assert (cfg.reward_fn.type, cfg.reward_fn.model_name) == ("reward_model", "org/rm")
    with pytest.raises(ConfigProblems, match="reward_model.enable=true needs reward_model.model.path"):
        load("reward_model.enable=True")


def test_exact_keys_cover_the_examples_key_set():
    """Every key of verl's example scripts kept here is in the table (mapped or noted)."""
    keys = set()
    for script in (HERE / "verl_examples").glob("*.sh"):
        keys |= set(re.findall(r"^\s*\+*([a-z_]+(?:\.[\w]+)+)=", script.read_text(), re.M))
    unknown = [k for k in keys if k not in EXACT and k not in NATIVE and verl_config._covering(k) is None]
    assert not unknown


def test_verl_ppo_megatron_trainer_yaml_loads_as_written():
    path = HERE / "verl_examples" / "ppo_megatron_trainer.yaml"
    cfg, notes = load("actor_rollout_ref.rollout.name=hf", "trainer.logger=[console]", "trainer.device=cpu",
                      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", path=path)
    assert (cfg.actor.strategy, cfg.critic.strategy, cfg.actor.tensor_model_parallel_size) == ("megatron",) * 2 + (2,)
    assert cfg.actor.gradient_checkpointing is None  # left at its default: Megatron's own recompute: not an FSDP setting
    assert any(n.startswith("actor_rollout_ref.actor.megatron.*: ") for n in notes)
