"""Reward files written for verl: ``verl.utils.reward_score`` imports served where verl is absent (and
verl's own modules where it is installed), ``reward_kwargs``, and verl's reward managers (naive, batch,
dapo, prime) over a custom function."""

import subprocess
import sys
import textwrap

import pytest

from verl_fast.config import verl_config
from verl_fast.trainer import preflight
from verl_fast.rewards import verl_managers, verl_shim
from verl_fast.rewards.interface import RewardInput
from verl_fast.trainer import catalog

catalog.register()


def sample(response, truth, source="openai/gsm8k", **extra):
    return RewardInput(prompt="q", response=response, ground_truth=truth, data_source=source, extra_info=dict(extra))


def reward_file(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


RECIPE = """\
    from verl.utils.reward_score import gsm8k, default_compute_score
    from verl.utils.reward_score.math import last_boxed_only_string, remove_boxed

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, method="strict", bonus=0.0):
        if data_source == "boxed":
            boxed = last_boxed_only_string(solution_str)
            return float(boxed is not None and remove_boxed(boxed) == ground_truth) + bonus
        if data_source == "default":
            return default_compute_score("openai/gsm8k", solution_str, ground_truth)
        return gsm8k.compute_score(solution_str, ground_truth, method=method, format_score=0.1) + bonus
    """


@pytest.mark.skipif(verl_shim.verl_installed(), reason="verl is installed: its own modules load")
def test_recipe_reward_file_runs_without_verl(tmp_path):
    path = reward_file(tmp_path, RECIPE)
    reward = verl_managers.callable_reward(f"{path}:compute_score")
    scores = reward([sample("so #### 72", "72"), sample("The answer is 72", "72"), sample("#### 71", "72"),
                     sample("x \\boxed{3/4} y", "3/4", "boxed"), sample("#### 5", "5", "default")])
    # verl's gsm8k: strict format; a formatted wrong answer earns format_score
    assert scores == [1.0, 0.0, pytest.approx(0.1), 1.0, 1.0]
    flexible = verl_managers.callable_reward(f"{path}:compute_score", kwargs={"method": "flexible", "bonus": 0.5})
    assert flexible([sample("The answer is 72", "72")]) == [1.5]  # reward_kwargs on every call


@pytest.mark.skipif(verl_shim.verl_installed(), reason="verl is installed: its own modules load")
def test_an_unserved_verl_module_is_one_line_naming_what_is_served(tmp_path):
    path = reward_file(tmp_path, "from verl.utils.reward_score import prime_code\n"
                                 "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                 "    return 0.0\n", "code_reward.py")
    cfg, _ = verl_config.load(None, ["actor.model_name=m", "reward_fn.type=callable",
                                     f"reward_fn.path={path}:compute_score"])
    with pytest.raises(ValueError) as e:
        preflight.config_parts(cfg.reward_fn)
    line = str(e.value)
    assert "\n" not in line and "verl.utils.reward_score.prime_code" in line
    assert "verl.utils.reward_score.gsm8k" in line and "pip install verl" in line


def test_installed_verl_wins(tmp_path):
    """A verl package on the path: its reward_score module is the one the file imports (in a fresh
    process, so that this one's modules stay as they are)."""
    fake = tmp_path / "site" / "verl" / "utils" / "reward_score"
    fake.mkdir(parents=True)
    for folder in (fake.parent.parent, fake.parent, fake):
        (folder / "__init__.py").write_text("")
    (fake / "gsm8k.py").write_text("def compute_score(solution_str, ground_truth, **kw):\n    return 42.0\n")
    path = reward_file(tmp_path, RECIPE.replace(", default_compute_score", "").replace(
        "from verl.utils.reward_score.math import last_boxed_only_string, remove_boxed\n", ""))
    code = ("from verl_fast.rewards import verl_managers\nfrom verl_fast.rewards.interface import RewardInput\n"
            f"r = verl_managers.callable_reward({path!r} + ':compute_score')\n"
            "print(r([RewardInput(prompt='q', response='#### 1', ground_truth='1', data_source='x')]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("[42.0]")


def test_batch_manager_calls_verls_batched_signature(tmp_path):
    path = reward_file(tmp_path, """\
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
            assert isinstance(data_sources, list) and len(solution_strs) == len(ground_truths) == len(extra_infos)
            return [{"score": scale * float(s.endswith(t)), "length": len(s)} if i % 2 == 0 else scale * 0.5
                    for i, (s, t) in enumerate(zip(solution_strs, ground_truths))]
        """)
    cfg, _ = verl_config.load(None, ["actor_rollout_ref.model.path=m", "algorithm.adv_estimator=grpo",
                                     "actor_rollout_ref.rollout.n=2", f"custom_reward_function.path={path}",
                                     "reward_model.reward_manager=batch",
                                     "+custom_reward_function.reward_kwargs.scale=2.0"])
    assert cfg.reward_fn.manager == "batch" and cfg.reward_fn.kwargs == {"scale": 2.0}
    (name, reward), = preflight.config_parts(cfg.reward_fn)  # no "data_sources is not a column"
    scores = reward([sample("a 5", "5"), sample("b", "5"), sample("c 6", "7")])
    assert scores == [2.0, 1.0, 0.0] and reward.last_extras == {"length": [3.0, 3.0]}


def test_batch_manager_needs_a_custom_function():
    with pytest.raises(ValueError, match="reward_fn.manager=batch .* set reward_fn.type=callable"):
        verl_config.load(None, ["actor_rollout_ref.model.path=m", "algorithm.adv_estimator=grpo",
                                "actor_rollout_ref.rollout.n=2", "reward_model.reward_manager=batch"])


def test_prime_scores_failures_zero_and_dapo_keeps_dict_results(tmp_path):
    path = reward_file(tmp_path, """\
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if "boom" in solution_str:
                raise RuntimeError("grader failed")
            return {"score": 1.0 if ground_truth in solution_str else -1.0, "acc": ground_truth in solution_str}
        """)
    base = ["actor_rollout_ref.model.path=m", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
            f"custom_reward_function.path={path}"]
    prime, _ = verl_config.load(None, base + ["reward_model.reward_manager=prime"])
    dapo, _ = verl_config.load(None, base + ["reward_model.reward_manager=dapo"])
    assert prime.reward_fn.on_error == "zero" and dapo.reward_fn.on_error == "raise"
    from verl_fast.rewards import build_reward

    reward = build_reward(prime.reward_fn)
    scores = reward([sample("x 7", "7"), sample("boom", "7"), sample("x 8", "7")])
    assert list(scores) == [1.0, 0.0, -1.0]
    with pytest.raises(Exception, match="grader failed"):
        build_reward(dapo.reward_fn)([sample("boom", "7")])
