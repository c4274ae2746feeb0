"""More of verl's examples and recipes, their command lines (and recipe configs) written here in verl's
shape with only paths and sizes changed: each runs one step on a tiny model or is refused in one line
per key that cannot be honoured. The list is in docs/verl_and_trl.md ("verl's examples and recipes")."""

import textwrap

import pytest

from test_verl_examples import home, run_one_step  # noqa: F401  (the fixture: a tiny model, gsm8k / math parquets)
from verl_fast.cli import main as cli
from verl_fast.config import LoraConfig, verl_config
from verl_fast.config.verl_config import ConfigProblems


def sizes(home, tmp_path):
    return [f"actor_rollout_ref.model.path={home / 'models' / 'tiny'}", "data.train_batch_size=2",
            "data.max_prompt_length=256", "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "trainer.logger=console",
            "trainer.total_training_steps=1", "trainer.val_before_train=False", f"trainer.default_local_dir={tmp_path}/run"]


def grpo_lora(home):
    """examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh (the keys that are not sizes or paths)."""
    return ["algorithm.adv_estimator=grpo", f"data.train_files={home}/data/gsm8k/train.parquet",
            f"data.val_files={home}/data/gsm8k/test.parquet", "data.filter_overlong_prompts=True",
            "data.truncation=error", "data.shuffle=False", "actor_rollout_ref.model.lora_rank=64",
            "actor_rollout_ref.model.lora_alpha=32", "actor_rollout_ref.actor.optim.lr=3e-6",
            "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False", "actor_rollout_ref.rollout.load_format=safetensors",
            "actor_rollout_ref.rollout.layered_summon=True", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
            "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.project_name=verl_grpo_example_gsm8k",
            "trainer.experiment_name=qwen2.5_3b_grpo_lora", "trainer.n_gpus_per_node=2", "trainer.nnodes=1",
            "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15"]


def megatron_grpo(home):
    """examples/grpo_trainer/run_qwen2-7b_math_megatron.sh: --config-path=config (verl's own folder) and
    --config-name='ppo_megatron_trainer.yaml'."""
    files = f"['{home}/data/gsm8k/train.parquet', '{home}/data/math/train.parquet']"
    return ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", "algorithm.adv_estimator=grpo",
            f"data.train_files={files}", f"data.val_files={files}", "data.return_raw_chat=True",
            "data.filter_overlong_prompts=True", "data.truncation=error", "actor_rollout_ref.model.use_fused_kernels=True",
            "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1", "algorithm.use_kl_in_reward=False",
            "trainer.critic_warmup=0", "trainer.project_name=verl_grpo_example_gsm8k_math",
            "trainer.experiment_name=qwen2_7b_megatron", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
            "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15"]


def test_grpo_lora_example_runs_a_step(home, tmp_path, monkeypatch):  # noqa: F811
    args = grpo_lora(home) + sizes(home, tmp_path)
    cfg, _ = verl_config.load(None, args)
    assert cfg.actor.lora == LoraConfig(r=64, alpha=32, target_modules="all-linear")
    assert cfg.trainer.save_freq == 20 and cfg.trainer.val_freq == 5
    record = run_one_step(args, tmp_path, monkeypatch)
    assert record["reward/mean"] == record["reward/mean"]


def test_megatron_grpo_example_picks_megatron(home, tmp_path, capsys, monkeypatch):  # noqa: F811
    """The config name picks Megatron, as in verl; with a GPU the step runs, without one the Megatron
    backend's start-up check refuses in one line (no traceback)."""
    args = megatron_grpo(home) + sizes(home, tmp_path)
    cfg, _ = verl_config.load(None, args[2:], config_path="config", config_name="ppo_megatron_trainer.yaml")
    assert cfg.actor.strategy == "megatron" and cfg.actor.tensor_model_parallel_size == 1
    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", *args])
    err = capsys.readouterr().err
    import torch

    if torch.cuda.is_available():  # benchmarks/gpu_run.sh runs it there
        assert code == 0, err[-2000:]
    else:
        assert code == 2 and "actor.strategy=megatron needs a CUDA device" in err, err[-2000:]
    assert "Traceback" not in err


SPPO = """\
    hydra:
      searchpath:
        - file://verl/trainer/config
    defaults:
      - ppo_trainer
      - _self_
    actor_rollout_ref:
      actor:
        _target_: recipe.sppo.config.SPPOActorConfig
        sppo_eta: 1.0
        optim:
          lr_warmup_steps: 15
      rollout:
        name: sglang
    algorithm:
      adv_estimator: null
      sppo_eta: 1.0
    """
PRIME = """\
    hydra:
      searchpath:
        - file://verl/trainer/config
    defaults:
      - ppo_trainer
      - _self_
    data:
      filter_accuracy: True
      accuracy_lower_bound: 0.2
      accuracy_upper_bound: 0.8
      oversample_factor: 4.0
      filter_truncate: True
      truncation: right
    actor_rollout_ref:
      rollout:
        n: 4
    reward_model:
      enable: True
      strategy: fsdp
      model:
        ref_path: ${reward_model.model.path}
        path: ${actor_rollout_ref.model.path}
        update: before
        beta_train: 0.05
      prime_granularity: token
      prime_norm: batch_norm
    """


@pytest.mark.parametrize("name, text, expected", [
    ("sppo_trainer", SPPO, ["actor_rollout_ref.actor.sppo_eta=1.0: SPPO's self-play preference loss is not available",
                            "algorithm.adv_estimator=None is not available here",
                            "unknown key algorithm.sppo_eta"]),
    ("prime_trainer", PRIME, ["data.filter_accuracy=True: PRIME's accuracy filter is not available here",
                              "reward_model.model.update=before: PRIME's implicit process reward model",
                              "unknown key reward_model.prime_granularity", "data.truncation=right is not available"]),
])
def test_recipes_whose_algorithm_is_not_here_are_refused_naming_each_key(name, text, expected, home, tmp_path,  # noqa: F811
                                                                         capsys):
    folder = tmp_path / "config"
    folder.mkdir()
    (folder / f"{name}.yaml").write_text(textwrap.dedent(text))
    args = [f"--config-path={folder}", f"--config-name={name}",
            f"data.train_files={home}/data/math/train.parquet"] + sizes(home, tmp_path)
    with pytest.raises(ConfigProblems) as e:
        verl_config.load(None, args[2:], config_path=str(folder), config_name=name)
    for want in expected:
        assert any(line.startswith(want) for line in e.value.lines), (want, e.value.lines)
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == len(e.value.lines)
