"""Config loading: defaults, the older spellings, overrides, and errors that name the key."""

import textwrap

import pytest

from verl_fast import config as C


def test_defaults_and_embedded_default_load():
    cfg = C.from_dict({})
    assert cfg.algorithm.type == "grpo"
    default = C.load(C.default_config_path())
    assert default.actor.model_name == "smollm2-135m-instruct"
    assert default.rollout.n == 8 and default.trainer.total_steps == 25


def test_seed_002_form(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent("""
        actor: {type: vllm, model_name: /models/llama, tensor_parallel_size: 2, dtype: bfloat16,
                enable_prefix_caching: true, max_num_seqs: 64}
        critic: {type: hf_transformers, model_name: /models/critic, use_flash_attention: true}
        reward_fn: {type: pairwise_ranking, reference_free: false}
        algorithm: {type: dpo, beta: 0.1, loss_type: sigmoid}
        trainer: {num_epochs: 1, per_device_train_batch_size: 4, gradient_accumulation_steps: 4,
                  learning_rate: 5.0e-7, max_grad_norm: 1.0}
    """))
    cfg = C.load(path)
    assert cfg.rollout.type == "vllm" and cfg.rollout.tensor_parallel_size == 2 and cfg.rollout.max_num_seqs == 64
    assert cfg.actor.lr == 5e-7 and cfg.actor.micro_batch_size == 4 and cfg.actor.ppo_mini_batch_size == 16
    assert cfg.algorithm.type == "dpo"


def test_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor: {lr: 1.0e-5}\n")
    cfg = C.load(path, ["actor.lr=3e-5", "rollout.n=4", "trainer.dataset=reasoning_gym:chain_sum"])
    assert cfg.actor.lr == 3e-5 and cfg.rollout.n == 4 and cfg.trainer.dataset == "reasoning_gym:chain_sum"
    with pytest.raises(ValueError, match="section.key=value"):
        C.load(path, ["lr=1"])


@pytest.mark.parametrize("data,match", [
    ({"actor": {"learning_rat": 1}}, r"unknown key actor.learning_rat; allowed keys in actor: \[.*'lr'"),
    ({"trainr": {}}, r"unknown section 'trainr'"),
    ({"actor": {"lr": "fast"}}, r"actor.lr must be a number, got 'fast'"),
    ({"rollout": {"n": 2.5}}, r"rollout.n must be an integer"),
    ({"rollout": {"n": 0}}, r"rollout.n must be >= 1, got 0"),
    ({"actor": {"loss_agg_mode": "mean"}}, r"actor.loss_agg_mode must be one of \['token-mean'"),
    ({"algorithm": {"type": "a2c"}}, r"algorithm.type must be one of"),
    ({"rollout": {"enable_prefix_caching": "yes"}}, r"must be true or false"),
    ({"algorithm": {"type": "grpo"}, "rollout": {"n": 1}}, r"grpo is not supported with rollout.n=1.*use rollout.n >= 2"),
    ({"rollout": {"speculative_config": {"model": "draft"}}}, r"speculative_config is not supported"),
    ({"rollout": {"guided_decoding": {"json": {}}}}, r"guided_decoding is not supported"),
    ({"algorithm": {"type": "dpo"}, "reward_fn": {"type": "reasoning_gym"}},
     r"dpo is not supported with reward_fn.type=reasoning_gym; leave reward_fn out"),
    ({"actor": {"use_kl_loss": True}, "algorithm": {"use_kl_in_reward": True}}, r"use one of them"),
    ({"reward_fn": {"type": "callable"}}, r"needs reward_fn.path"),
    ({"actor": {"clip_ratio_c": 1.0}}, r"clip_ratio_c must be > 1"),
    ({"actor": {"loss_scale_factor": 0}}, r"actor.loss_scale_factor must be > 0"),
    ({"critic": {"loss_scale_factor": -2.0}}, r"critic.loss_scale_factor must be > 0"),
])
def test_errors_name_the_key(data, match):
    with pytest.raises(ValueError, match=match):
        C.from_dict(data)


def test_program_exit_codes(tmp_path):
    """`verl-fast` as a program leaves without the interpreter's teardown: its exit code and output
    must still be those of the command (0 for help, 2 and the one-line message for a bad key)."""
    import os
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "verl_fast", *args], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)

    helped = run("--help")
    assert helped.returncode == 0 and "train" in helped.stdout
    bad = run("train", "--set", "actor.lrr=1", "--output_dir", str(tmp_path / "run"))
    assert bad.returncode == 2 and "unknown key actor.lrr" in bad.stderr and "Traceback" not in bad.stderr
    assert run("bogus").returncode == 2  # argparse's usage error


def test_the_config_stands_on_its_own_and_the_run_registers_its_choices(tmp_path):
    """In a plain script, ``verl_fast.config.load`` / ``from_dict`` work with no other call and import nothing
    else of verl_fast; a value no module has registered yet is checked where it is looked up (one line naming
    the choices). ``verl_fast.trainer.catalog.register()`` (what ``verl-fast train`` and RLTrainer call) imports
    the modules that own the choices; then validation names them, in the order they always had."""
    import subprocess
    import sys

    code = "\n".join([
        "import sys",
        "import verl_fast.config as C",
        "def loaded(): return sorted(m for m in sys.modules if m.startswith('verl_fast.'))",
        "cfg = C.load(C.default_config_path(), ['actor.lr=1e-5'])",
        "assert cfg.actor.lr == 1e-5 and cfg.algorithm.type == 'grpo'",
        "assert C.from_dict({'algorithm': {'type': 'ppo'}, 'rollout': {'type': 'vllm'}}).algorithm.type == 'ppo'",
        "assert all(m.split('.')[1] == 'config' for m in loaded()), loaded()",
        "bad = C.from_dict({'algorithm': {'type': 'nope'}})",
        "from verl_fast.algos import registry",
        "try:",
        "    registry.spec(bad)",
        "except ValueError as e:",
        "    assert \"algorithm.type must be one of ['grpo', 'drgrpo'\" in str(e) and \"got 'nope'\" in str(e), e",
        "else:",
        "    raise AssertionError('an unknown algorithm was looked up')",
        "from verl_fast.trainer import catalog",
        "catalog.register()",
        "try:",
        "    C.from_dict({'algorithm': {'type': 'nope'}})",
        "except ValueError as e:",
        "    assert 'algorithm.type must be one of' in str(e), e",
        "else:",
        "    raise AssertionError('validated an unknown algorithm once registered')",
        "assert list(C.ALGORITHMS) == ['grpo', 'drgrpo', 'ppo', 'rloo', 'reinforce_pp', 'reinforce_pp_baseline',"
        " 'remax', 'dpo', 'online_dpo', 'kto', 'orpo', 'simpo', 'cpo', 'sft']",
        "assert list(C.STRATEGIES) == ['auto', 'fsdp2', 'fsdp1', 'none', 'megatron']",
        "assert list(C.ENGINES) == ['auto', 'hf', 'vllm']",
    ])
    # run outside the repository: from its root, `import verl_fast` would find the unbuilt source folder
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
