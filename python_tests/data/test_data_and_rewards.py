"""Rewards (rule-based, reward model, callables from YAML), RLDataProcessor's inputs, and the CLI."""

import json
import sys
import textwrap

import pytest
import torch

from tiny_models import build_tokenizer, save_tiny_model
from verl_fast import config as C
from verl_fast.data import RLDataProcessor
from verl_fast.rewards import (GSM8KReward, ReasoningGymReward, RewardInput, RewardModel, as_reward_function,
                               build_reward, gsm8k_answer, last_number)


def test_answer_extraction():
    assert last_number("so 3 + 4 = 7.") == "7"
    assert last_number("it is -12") == "-12" and last_number("1,234 apples") == "1234"
    assert last_number("no digits") is None
    assert gsm8k_answer("work... #### 42") == "42" and gsm8k_answer("The answer is 5") == "5"
    scores = GSM8KReward()([RewardInput("q", "#### 42", "He had... #### 42"), RewardInput("q", "41", "42"),
                            RewardInput("q", "42.0", "42")])
    assert scores == [1.0, 0.0, 1.0]


def test_reasoning_gym_reward_scores_the_last_number():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=3, min_terms=2, max_terms=2, min_digits=1,
                                         max_digits=1)[0]
    answer = entry["answer"]
    scores = ReasoningGymReward()([RewardInput("q", f"The answer is {answer}.", entry),
                                   RewardInput("q", f"{int(answer) + 1}", entry), RewardInput("q", "no idea", entry)])
    assert scores == [1.0, 0.0, 0.0]


def test_callables_verl_signature_batch_and_errors():
    per_sample = as_reward_function(lambda data_source, solution_str, ground_truth, extra_info: {"score": 2.0})
    assert per_sample([RewardInput("p", "r")]) == [2.0]
    batched = as_reward_function(lambda samples: [len(s.response) for s in samples])
    assert batched([RewardInput("p", "abc"), RewardInput("p", "")]) == [3.0, 0.0]
    with pytest.raises(TypeError, match="keyword arguments"):
        as_reward_function(lambda a, b: 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        as_reward_function(lambda solution_str: float("nan"))([RewardInput("p", "r")])


def test_callable_from_yaml_path(tmp_path):
    module = tmp_path / "my_reward.py"
    module.write_text("def score(solution_str, ground_truth):\n    return float(solution_str == ground_truth)\n")
    cfg = C.from_dict({"reward_fn": {"type": "callable", "path": f"{module}:score"}})
    fn = build_reward(cfg.reward_fn)
    assert fn([RewardInput("p", "x", "x"), RewardInput("p", "y", "x")]) == [1.0, 0.0]
    sys.path.insert(0, str(tmp_path))
    try:
        assert build_reward(C.from_dict({"reward_fn": {"type": "callable", "path": "my_reward:score"}}).reward_fn)
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(ValueError, match="no attribute"):
        build_reward(C.from_dict({"reward_fn": {"type": "callable", "path": f"{module}:nope"}}).reward_fn)


def test_reward_model_of_another_family(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = save_tiny_model(tmp_path / "rm", family="llama")
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    model.config.pad_token_id = model.config.eos_token_id
    rm = RewardModel(model, AutoTokenizer.from_pretrained(path), batch_size=2)
    samples = [RewardInput("What is 1 + 1?", "2"), RewardInput("What is 1 + 1?", "please minus the answer"),
               RewardInput("hello", "world")]
    scores = rm(samples)
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores) and len(set(scores)) > 1
    assert rm(samples[:1]) == pytest.approx(scores[:1], abs=1e-5)  # batching does not change a score


def test_data_sources_load_the_same_rows(tmp_path):
    import datasets
    import pandas as pd

    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"ground_truth": str(2 * i)}, "extra_info": {"index": i}} for i in range(3)]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    proc = RLDataProcessor(build_tokenizer(), max_prompt_length=64, max_response_length=8,
                           system_prompt="Answer with just the number.")
    encoded = [proc.encode_all(proc.load(src)) for src in
               (tmp_path / "d.parquet", tmp_path / "d.jsonl", str(tmp_path / "hf"),
                datasets.Dataset.from_list(rows), rows)]
    for e in encoded:
        assert [r.prompt_ids for r in e] == [r.prompt_ids for r in encoded[0]]
        assert [r.ground_truth for r in e] == ["0", "2", "4"]
    assert "<|im_start|>system\nAnswer with just the number." in encoded[0][0].prompt_text
    gym = proc.load("reasoning_gym:chain_sum", size=4, seed=1, min_terms=2, max_terms=2)
    assert len(gym) == 4 and gym[0]["reward_model"]["ground_truth"]["metadata"]["source_dataset"] == "chain_sum"
    with pytest.raises(FileNotFoundError):
        proc.load(tmp_path / "missing.parquet")


def test_truncation_and_dpo_pairs():
    tok = build_tokenizer()
    long_prompt = "What is 1 + 2? " * 40
    left = RLDataProcessor(tok, max_prompt_length=16, max_response_length=4,
                           overlong_prompts="truncate_left").encode({"prompt": long_prompt})
    assert len(left.prompt_ids) == 16
    with pytest.raises(ValueError, match="more than max_prompt_length=16"):
        RLDataProcessor(tok, max_prompt_length=16, overlong_prompts="error").encode({"prompt": long_prompt})
    pairs = RLDataProcessor(tok, max_prompt_length=64, max_response_length=4).build_dpo_dataset([
        {"question": "q1", "answer_1": "good answer", "answer_2": "bad", "score_1": 2, "score_2": 1},
        {"question": "q2", "answer_1": "a", "answer_2": "b", "score_1": 1, "score_2": 1},  # a tie: dropped
        {"prompt": "q3", "chosen": "yes", "rejected": "no"}])
    assert [(p.chosen, p.rejected) for p in pairs] == [("good answer", "bad"), ("yes", "no")]
    assert pairs[1].chosen_ids[-1] == tok.eos_token_id  # short responses end in EOS
    assert all(len(p.chosen_ids) <= 4 and len(p.rejected_ids) <= 4 for p in pairs)


def test_cli_train_runs_a_config(tmp_path, capsys):
    from verl_fast.cli.main import main

    path = save_tiny_model(tmp_path / "m", family="qwen2")
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps({"prompt": f"What is {i} + 1?",
                                                                 "reward_model": {"ground_truth": str(i + 1)}})
                                                     for i in range(4)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(textwrap.dedent(f"""
        actor: {{model_name: {path}, lr: 1.0e-3}}
        rollout: {{type: hf, n: 2, max_new_tokens: 4}}
        reward_fn: {{type: gsm8k}}
        trainer: {{total_steps: 2, train_batch_size: 2, progress_bar: false, device: cpu}}
    """))
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--dataset_path", str(tmp_path / "data.jsonl"),
                 "--output_dir", str(out), "--set", "trainer.save_freq=1"]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert (out / "reward_curve.png").stat().st_size > 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    capsys.readouterr()
    assert main(["train", "--config", str(cfg), "--set", "actor.lrr=1"]) == 2  # a config error: one line
    assert "unknown key actor.lrr" in capsys.readouterr().err
