"""What the asynchronous-RL tests share: toy prompts and a reward that varies within a group."""

PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}, "data_source": "toy"}
           for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3)]]


def reward(solution_str, ground_truth):
    return float(len(solution_str) % 3 == 0)
