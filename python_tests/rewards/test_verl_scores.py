"""verl's rule-based scorers (verl/utils/reward_score) by behaviour, on the strings verl's scorers get,
and reward_fn.type auto routing each row by its data_source."""

import pytest

from verl_fast.rewards import DataSourceReward, GuardedReward, RewardInput
from verl_fast.rewards import verl_scores as vs
from verl_fast.rewards.by_source import check_source


@pytest.mark.parametrize("response, truth, score", [
    ("Natalia sold 48/2 = 24 clips in May. 48+24 = 72. #### 72", "72", 1.0),
    ("The answer is 14", "14", 0.0),  # strict: the #### format is the point
    ("#### 14.", "14", 0.0),  # the dot is part of the number verl reads ("14.")
    ("#### 1,000", "1000", 1.0),  # commas dropped
    ("####14", "14", 0.0),  # the marker needs its space
    ("#### 13 then #### 14", "14", 1.0),  # the last one
    ("#### -3", "-3", 1.0),
    ("#### 14" + " x" * 200, "14", 0.0),  # only the last 300 characters are read
    ("#### 72", 72, 1.0),  # a numeric ground truth compares as its text
])
def test_gsm8k_strict(response, truth, score):
    assert vs.gsm8k_strict(response, truth) == score


@pytest.mark.parametrize("response, truth, score", [
    ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("so \\boxed{\\frac12}", "\\frac{1}{2}", 1.0),  # shorthand fractions
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),  # 0.5 is written as a fraction
    ("so \\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
    ("\\boxed{7/8}", "\\frac{7}{8}", 1.0),  # a/b as \frac{a}{b}
    ("\\boxed{k = 3}", "3", 1.0),  # a short left-hand side dropped
    ("\\boxed{5\\text{ cm}}", "5", 1.0),  # units on the right
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
    ("\\boxed 5$ and more", "5", 1.0),  # \boxed x up to a $
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # braces never close
    ("\\fbox{3}", "3", 0.0),  # found, but verl's unboxing takes \boxed only
    ("the answer is 3", "3", 0.0),
    ("\\boxed{2} then \\boxed{3}", "3", 1.0),
])
def test_math_boxed(response, truth, score):
    assert vs.math_boxed(response, truth) == score


@pytest.mark.parametrize("response, truth, score", [
    ("Answer: 42", "42", 1.0),
    ("answer : 42 dollars", "42", 1.0),  # case, spaces and units
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
    ("Answer: 41", "42", -1.0),
    ("no answer line", "42", -1.0),
    ("Answer: 41\nAnswer: 42", "42", 1.0),
])
def test_math_dapo(response, truth, score):
    out = vs.math_dapo(response, truth)
    assert out == {"score": score, "acc": float(score > 0)}


@pytest.mark.parametrize("response, truth, score", [
    ("<answer>The Paris.</answer>", {"target": ["paris"]}, 1.0),
    ("<answer>London</answer>", {"target": ["Paris", "London"]}, 1.0),
    ("<answer>Lyon</answer>", {"target": ["Paris"]}, 0.0),
    ("Paris", {"target": ["Paris"]}, 0.0),
    ("<answer>x</answer>" * 11 + "<answer>Paris</answer>", {"target": ["Paris"]}, 0.25),
])
def test_search_r1_em(response, truth, score):
    assert vs.search_r1_em(response, truth) == score


def sample(source, response, truth):
    return RewardInput(prompt="p", response=response, ground_truth=truth, data_source=source)


def test_auto_routes_each_row_by_its_data_source():
    reward = GuardedReward(DataSourceReward())
    samples = [sample("openai/gsm8k", "#### 72", "72"), sample("openai/gsm8k", "The answer is 72", "72"),
               sample("lighteval/MATH", "\\boxed{0.5}", "\\frac{1}{2}"),
               sample("HuggingFaceH4/MATH-500", "\\boxed{1}", "2"),
               sample("math_dapo", "Answer: 3", "3"), sample("aime2024", "Answer: 4", "3"),
               sample("searchR1_nq", "<answer>paris</answer>", {"target": ["Paris"]})]
    assert reward(samples) == [1.0, 0.0, 1.0, 0.0, 1.0, -1.0, 1.0]
    assert reward.last_extras == {"acc": 0.5}  # math_dapo's accuracy, over the rows that report it


def test_auto_reasoning_gym_rows():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=0)[0]
    answer = entry["answer"]
    reward = DataSourceReward()
    assert reward([sample("reasoning_gym/chain_sum", f"it is {answer}", entry)]) == [1.0]


@pytest.mark.parametrize("source, match", [
    ("my_data", r"data_source 'my_data' has no built-in scorer .*custom_reward_function.path"),
    ("numina_olympiads", r"scored in verl with prime_math's sympy grader, which is not built in here"),
    ("apps", r"a code sandbox"),
    ("", r"data_source '' has no built-in scorer"),
])
def test_unknown_source_is_one_line_naming_it(source, match):
    with pytest.raises(ValueError, match=match) as e:
        check_source(source, "data.parquet row 0")
    assert str(e.value).startswith("data.parquet row 0: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("response, truth, expected", [
    ("<think>angles sum</think> so \\boxed{30}", "30", 1.0),  # right and formatted
    ("so \\boxed{30}", "30", 0.9),  # right, no think block
    ("<think>x</think> \\boxed{31}", "30", 0.1),  # formatted, wrong
    ("<think>x</think> 30", "30", 0.0),  # no box: neither
    ("<think>x</think> \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),  # MATH normalisation of the answer
])
def test_geometry3k_routes_to_geo3k(response, truth, expected):
    reward = DataSourceReward()
    assert reward([sample("hiyouga/geometry3k", response, truth)]) == [pytest.approx(expected)]
