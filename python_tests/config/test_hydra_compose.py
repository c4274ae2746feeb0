"""Hydra's entry as verl's users call it (``--config-path`` / ``--config-name``, ``defaults:`` lists,
``+`` / ``++`` / ``~``, interpolations) and verl's defaults, on configs written here in the shape of
verl's ``verl/trainer/config`` and its examples' folders."""

import resource
import textwrap
import time
import tracemalloc

import pytest

from verl_fast.cli import main as cli
from verl_fast.config import hydra_compose, verl_config
from verl_fast.config.verl_config import ConfigProblems
from verl_fast.trainer import catalog

catalog.register()
BASE = ["actor_rollout_ref.model.path=m", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo"]


def write(folder, name, text):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_an_example_folder_composes_onto_the_built_in_ppo_trainer(tmp_path, monkeypatch):
    """An examples/*/config folder: hydra.searchpath names verl's folder, which the user does not
    have: ppo_trainer comes from the built-in tree."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "config", "my_grpo.yaml", """\
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_trainer
          - _self_
        data:
          max_prompt_length: 100
          train_batch_size: 8
        actor_rollout_ref:
          rollout:
            n: 4
        """)
    cfg, notes = verl_config.load(None, BASE[:1] + ["actor_rollout_ref.actor.ppo_mini_batch_size=2"],
                                  config_path=str(tmp_path / "config"), config_name="my_grpo")
    assert cfg.trainer.max_prompt_length == 100 and cfg.rollout.n == 4 and cfg.trainer.train_batch_size == 8
    assert cfg.algorithm.type == "ppo"  # verl's default estimator, gae
    assert cfg.actor.strategy == "auto"  # dp_actor: fsdp


def test_config_name_picks_the_backend_as_in_verl():
    megatron, _ = verl_config.load(None, BASE, config_name="ppo_megatron_trainer")
    fsdp, _ = verl_config.load(None, BASE, config_name="ppo_trainer")
    plain, _ = verl_config.load(None, BASE)
    assert megatron.actor.strategy == "megatron" and megatron.critic.strategy == "megatron"
    assert fsdp.actor.strategy == plain.actor.strategy == "auto"
    with pytest.raises(ValueError, match="--config-name ppo_trainr: verl has no such built-in config"):
        verl_config.load(None, BASE, config_name="ppo_trainr")


def test_verl_folder_layout_with_groups_packages_self_and_overrides(tmp_path):
    """A trainer yaml as verl writes ppo_trainer.yaml: group@package entries, a group file's own
    defaults with ../group@package, _self_ first or last, override, optional and a null option."""
    conf = tmp_path / "conf"
    write(conf, "trainer.yaml", """\
        defaults:
          - actor@actor_rollout_ref.actor: my_actor
          - data@data: legacy_data
          - optional missing_group@x: nothing
          - critic@critic: null
          - override actor/lr_choice: fast
          - _self_
        actor_rollout_ref:
          model:
            path: m
          actor:
            ppo_mini_batch_size: 2
        data:
          train_batch_size: 4
        """)
    write(conf, "actor/my_actor.yaml", """\
        defaults:
          - ../optim@optim: adam
          - actor_common
          - lr_choice: slow
          - _self_
        strategy: megatron
        ppo_epochs: 3
        """)
    write(conf, "actor/actor_common.yaml", "ppo_epochs: 2\nclip_ratio_c: 4.0\n")
    write(conf, "actor/lr_choice/slow.yaml", "# @package _global_\nactor_rollout_ref:\n  actor:\n    optim:\n"
                                             "      lr: 1.0e-7\n")
    write(conf, "actor/lr_choice/fast.yaml", "# @package _global_\nactor_rollout_ref:\n  actor:\n    optim:\n"
                                             "      lr: 3.0e-6\n")
    write(conf, "optim/adam.yaml", "lr: 1.0e-5\nweight_decay: 0.05\n")
    write(conf, "data/legacy_data.yaml", "max_prompt_length: 77\ntrain_batch_size: 1024\n")
    composed = hydra_compose.compose(str(conf), "trainer", None)
    actor = composed.data["actor_rollout_ref"]["actor"]
    assert actor["optim"] == {"lr": 3e-6, "weight_decay": 0.05}  # override: fast, over adam's and slow's
    assert actor["ppo_epochs"] == 3 and actor["clip_ratio_c"] == 4.0  # _self_ last wins over actor_common
    assert composed.data["data"] == {"max_prompt_length": 77, "train_batch_size": 4}
    assert "critic" not in composed.data and "x" not in composed.data
    cfg, _ = verl_config.load(conf / "trainer.yaml", ["actor_rollout_ref.rollout.n=2"])
    assert cfg.actor.strategy == "megatron" and cfg.actor.ppo_epochs == 3 and cfg.actor.weight_decay == 0.05
    with pytest.raises(ValueError, match="defaults entry .*no config data/other.yaml"):
        write(conf, "bad.yaml", "defaults:\n  - data@data: other\n")
        hydra_compose.compose(str(conf), "bad", None)


def test_verl_ppo_trainer_yaml_with_its_defaults_list_loads_by_config(tmp_path):
    """--config naming a copy of verl's ppo_trainer.yaml (a defaults list of verl's group files, which
    the user did not copy): composed onto the built-in groups; no 'unknown key defaults'."""
    path = write(tmp_path, "ppo_trainer.yaml", """\
        defaults:
          - actor@actor_rollout_ref.actor: dp_actor
          - data@data: legacy_data
          - reward_manager@reward_manager
          - ref@actor_rollout_ref.ref: dp_ref
          - rollout@actor_rollout_ref.rollout: rollout
          - model@actor_rollout_ref.model: hf_model
          - critic@critic: dp_critic
          - reward_model@reward_model: dp_reward_loop
          - algorithm@algorithm.rollout_correction: rollout_correction
          - _self_
        actor_rollout_ref:
          hybrid_engine: true
          rollout:
            layered_summon: False
            name: ???
        custom_reward_function:
          path: null
          name: compute_score
        algorithm:
          _target_: verl.trainer.config.AlgoConfig
          gamma: 1.0
          adv_estimator: grpo
        trainer:
          total_epochs: 2
        """)
    cfg, notes = verl_config.load(path, BASE)
    assert cfg.algorithm.type == "grpo" and cfg.trainer.num_epochs == 2 and cfg.actor.strategy == "auto"
    assert not any("unknown key" in n for n in notes)


def test_hydra_plus_plusplus_and_tilde(tmp_path):
    cfg, _ = verl_config.load(None, BASE + ["+trainer.val_before_train=false", "++data.max_prompt_length=99",
                                            "data.val_files=v.parquet"])
    assert cfg.trainer.val_before_train is False and cfg.trainer.max_prompt_length == 99
    # ~key: verl's default for that key is not applied (ours stays)
    removed, _ = verl_config.load(None, BASE + ["~actor_rollout_ref.actor.optim.weight_decay"])
    kept, _ = verl_config.load(None, BASE)
    assert removed.actor.weight_decay == 0.0 and kept.actor.weight_decay == 0.01
    path = write(tmp_path, "c.yaml", "defaults: [ppo_trainer, _self_]\ntrainer:\n  total_epochs: 7\n")
    cfg, _ = verl_config.load(path, BASE + ["~trainer.total_epochs"])
    assert cfg.trainer.num_epochs == 1  # the file's key removed, and verl's default with it: ours
    with pytest.raises(ValueError, match="~trainer.no_such_key: the config has no key trainer.no_such_key"):
        verl_config.load(None, BASE + ["~trainer.no_such_key"])


def test_verl_defaults_are_verls_documented_values(tmp_path):
    """verl/trainer/config: val_before_train true, optim.weight_decay 0.01, save_freq / test_freq -1
    (never), lr 1e-6 (actor) / 1e-5 (critic), total_epochs 30, kl_loss_coef 0.001 low_var_kl, clip
    0.2, loss_agg_mode token-mean, rollout.n 1, data.truncation error; printed once, as one note."""
    cfg, notes = verl_config.load(None, BASE + ["data.val_files=v.parquet"])
    a, t = cfg.actor, cfg.trainer
    assert t.val_before_train is True and a.weight_decay == 0.01 and cfg.critic.weight_decay == 0.01
    assert t.save_freq == -1 and t.val_freq == -1 and t.num_epochs == 30
    assert a.lr == pytest.approx(1e-6) and cfg.critic.lr == pytest.approx(1e-5)
    assert a.kl_loss_coef == pytest.approx(0.001) and a.kl_loss_type == "low_var_kl"
    assert a.clip_ratio_low == a.clip_ratio_high == pytest.approx(0.2) and a.loss_agg_mode == "token-mean"
    assert t.overlong_prompts == "error" and t.output_dir == "checkpoints/verl_examples/gsm8k"
    applied = [n for n in notes if n.startswith("verl's defaults applied")]
    assert len(applied) == 1 and "trainer.val_before_train=True" in applied[0]
    assert "trainer.save_freq=-1" in applied[0] and "optim.weight_decay=0.01" in applied[0]
    # without a validation set verl's placeholder val_files would not load: no validation asked for
    cfg, _ = verl_config.load(None, BASE)
    assert cfg.trainer.val_before_train is False
    # our own layout takes our defaults
    ours, notes = verl_config.load(None, ["actor.model_name=m"])
    assert ours.actor.weight_decay == 0.0 and ours.trainer.save_freq == 0 and not notes
    # a user's value wins over verl's default that maps to the same key of ours
    cfg, _ = verl_config.load(None, BASE + ["actor_rollout_ref.actor.clip_ratio=0.3"])
    assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio_high == pytest.approx(0.3)


def test_sft_defaults_are_verls():
    cfg, notes = verl_config.load(None, ["model.partial_pretrain=m", "data.train_files=t.parquet"], tree="sft")
    assert cfg.algorithm.type == "sft" and cfg.actor.lr == pytest.approx(1e-5) and cfg.actor.weight_decay == 0.01
    assert cfg.actor.warmup_ratio == pytest.approx(0.1) and cfg.actor.lr_scheduler == "cosine"
    assert cfg.trainer.train_batch_size == 256 and cfg.actor.micro_batch_size == 4 and cfg.trainer.seed == 1
    assert cfg.algorithm.sft_max_length == 1024 and cfg.algorithm.sft_truncation == "error"
    assert cfg.algorithm.sft_columns == {"prompt": "question", "completion": "answer"}


def test_oc_env_and_relative_interpolations(monkeypatch):
    monkeypatch.setenv("MY_MODEL", "/models/tiny")
    cfg, _ = verl_config.load(None, BASE[1:] + ["actor_rollout_ref.model.path=${oc.env:MY_MODEL}",
                                                "trainer.project_name=${oc.env:NOT_SET_HERE,proj}",
                                                "trainer.experiment_name=${..trainer.project_name}-x"])
    assert cfg.actor.model_name == "/models/tiny" and cfg.trainer.wandb_project == "proj"
    assert cfg.trainer.run_name == "proj-x"
    with pytest.raises(ConfigProblems, match="uses the resolver oc.decode, which is not available here"):
        verl_config.load(None, BASE + ["trainer.project_name=${oc.decode:x}"])


def interpolation_bomb():
    """~0.5 MB of arguments: a long value and five keys of ten references each to the one before."""
    base = "x" * 500_000
    keys = ["trainer.project_name"] + [f"+trainer.bomb{i}" for i in range(1, 6)]
    args = [f"{keys[0]}={base}"]
    for i in range(1, 6):
        before = keys[i - 1].lstrip("+")
        args.append(f"{keys[i]}=" + "${" + before + "}" * 1 + ("${" + before + "}") * 9)
    return args


def test_interpolation_bomb_is_refused_before_expanding():
    """#64 finding 6: the size, count and depth of every interpolation are measured first; nothing is
    expanded, the error is one short line naming the key."""
    args = BASE + interpolation_bomb()
    assert sum(len(a) for a in args) > 500_000
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(ConfigProblems) as e:
        verl_config.load(None, args)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(e.value.lines) == 1 and len(str(e.value)) < 300
    assert str(e.value).startswith("trainer.bomb1: its ${...} interpolations would expand to more than")
    assert peak < 64 << 20 and seconds < 60  # the expansion would be 50 GB of text (the time: YAML's parse)
    # a deep chain and a cycle, named
    chain = [f"+trainer.c{i}=" + "${trainer.c" + str(i + 1) + "}" for i in range(20)] + ["+trainer.c20=end"]
    with pytest.raises(ConfigProblems, match="interpolations nest more than 16 deep"):
        verl_config.load(None, BASE + chain)
    with pytest.raises(ConfigProblems, match="in a cycle"):
        verl_config.load(None, BASE + ["trainer.project_name=${trainer.experiment_name}",
                                       "trainer.experiment_name=${trainer.project_name}"])


def test_interpolation_bomb_through_the_command_line_is_one_line(capsys):
    assert cli.main(["train", *BASE, *interpolation_bomb(), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.bomb1" in err[0] and len(err[0]) < 300
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert usage < 4 << 20  # KiB: the process never held gigabytes


def test_options_anywhere_among_the_overrides(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", BASE[0], "--print-config", *BASE[1:], "trainer.total_training_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "total_steps: 3" in out and "model_name: m" in out
    assert cli.main(["train", "--config-name=ppo_megatron_trainer", *BASE, "--print-config"]) == 0
    assert "strategy: megatron" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["train", *BASE, "--no-such-option"])


def test_did_you_mean_only_when_close_and_the_other_trainer_named():
    with pytest.raises(ConfigProblems) as e:
        verl_config.load(None, BASE + ["actor_rollout_ref.model.torch_dtype=bfloat16", "model.partial_pretrain=x",
                                       "actor_rollout_ref.actor.temperature=0.7", "trainer.total_epoch=3"])
    lines = e.value.lines
    assert not any("mtp" in line for line in lines)
    assert any(line.startswith("unknown key actor_rollout_ref.model.torch_dtype") and "did you mean" not in line
               for line in lines)
    assert "unknown key model.partial_pretrain; this is a key of verl's SFT trainer: run it with verl-fast sft" \
        in lines
    assert "unknown key actor_rollout_ref.actor.temperature; did you mean actor_rollout_ref.rollout.temperature?" \
        in lines
    assert "unknown key trainer.total_epoch; did you mean trainer.total_epochs?" in lines
    with pytest.raises(ConfigProblems) as e:
        verl_config.load(None, ["model.partial_pretrain=m", "actor_rollout_ref.rollout.n=4"], tree="sft")
    assert e.value.lines == ["unknown key actor_rollout_ref.rollout.n; this is a key of verl's PPO trainer: run it "
                             "with verl-fast train"]
