"""What the asynchronous-RL tests share: toy prompts, a reward that varies within a group, a tiny model."""

import pytest

from tiny_models import save_tiny_model

PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}, "data_source": "toy"}
           for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3)]]


def reward(solution_str, ground_truth):
    return float(len(solution_str) % 3 == 0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A tiny Qwen2 model and tokenizer saved as one HF folder, once per test module."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")
