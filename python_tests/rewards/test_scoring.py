"""rewards/scoring.py: a generation's samples as RewardInput rows, scored on this thread or on a daemon
thread, and one outcome on every rank (a stop or a timeout on one rank raises on both, over gloo)."""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_fast.data import PromptRow
from verl_fast.rewards import CallableReward, GuardedReward, RewardStopped, RewardTimeout, WeightedRewards, scoring
from verl_fast.rewards.interface import TrainerState
from verl_fast.records.generation import GenerationOutput

BATCH = [PromptRow([1, 2], "p0", ground_truth="4", data_source="a", extra_info={"k": 0}, columns={"c": 0}),
         PromptRow([3], "p1", ground_truth="7", data_source="b", extra_info={"k": 1}, columns={"c": 1})]
# 3 samples: two of prompt 0, one of prompt 1; right-padded with 0
GEN = GenerationOutput(prompt_index=torch.tensor([0, 0, 1]),
                       response_ids=torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 10]]),
                       response_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]),
                       logprobs=None, texts=["r0", "r1", "r2"])


def weighted(fn, timeout_s=30.0):
    return WeightedRewards([("f", 1.0, GuardedReward(CallableReward(fn), "raise", timeout_s))])


def test_reward_inputs_are_the_samples_with_their_prompts():
    rows = scoring.reward_inputs(BATCH, GEN, step=3, max_steps=10)
    expected = [("p0", "r0", "4", "a", {"k": 0}, {"c": 0}, [5, 6]),
                ("p0", "r1", "4", "a", {"k": 0}, {"c": 0}, [7]),
                ("p1", "r2", "7", "b", {"k": 1}, {"c": 1}, [8, 9, 10])]
    assert [(r.prompt, r.response, r.ground_truth, r.data_source, r.extra_info, r.columns, r.completion_ids)
            for r in rows] == expected
    assert all(r.trainer_state == TrainerState(global_step=3, max_steps=10) for r in rows)


@pytest.mark.parametrize("beside", [False, True])
def test_scores_on_this_thread_or_beside(beside):
    threads = []

    def fn(solution_str, ground_truth):
        threads.append(threading.current_thread().name)
        return float(len(solution_str) + int(ground_truth))

    def two(solution_str):
        return 2.0 if solution_str != "r1" else "not a number"  # zeroed: on_error zero

    reward = WeightedRewards([("f", 1.0, GuardedReward(CallableReward(fn), "raise", 30.0)),
                              ("g", 0.5, GuardedReward(CallableReward(two), "zero", 30.0))])
    samples = scoring.reward_inputs(BATCH, GEN, 0, None)
    if beside:
        got = scoring.wait(scoring.start(reward, samples), torch.device("cpu"))
    else:
        got = scoring.score(reward, samples, threading.Event(), torch.device("cpu"))
    assert got.dtype == torch.float32 and got.device.type == "cpu" and got.tolist() == [7.0, 6.0, 10.0]
    assert reward.last_metrics == {"reward/f/mean": pytest.approx(7.0), "reward/g/mean": pytest.approx(4 / 3)}
    assert reward.last_errors == 1
    # timeout_s set: the batch scores on a thread of the reward's own (deadline.py), either way
    assert len(threads) == 3 and all(name == "reward fn" for name in threads), threads


def test_an_error_of_the_reward_is_raised_as_it_is():
    def broken(solution_str):
        raise ValueError("the scorer broke")

    samples = scoring.reward_inputs(BATCH, GEN, 0, None)
    with pytest.raises(ValueError, match="the scorer broke"):
        scoring.score(weighted(broken), samples)
    with pytest.raises(ValueError, match="the scorer broke"):
        scoring.wait(scoring.start(weighted(broken), samples))


def test_one_process_raises_its_own_stop_or_timeout():
    hang = threading.Event()
    slow = weighted(lambda solution_str: hang.wait(5) or 1.0, timeout_s=0.1)
    samples = scoring.reward_inputs(BATCH, GEN, 0, None)
    with pytest.raises(RewardTimeout, match="timeout_s=0.1"):
        scoring.score(slow, samples)
    with pytest.raises(RewardTimeout, match="timeout_s=0.1"):
        scoring.wait(scoring.start(slow, samples))
    hang.set()
    scoring.raise_together(None)  # nothing on any rank: nothing raised


def test_beside_passes():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    off_thread, main_thread = weighted(lambda solution_str: 1.0), weighted(lambda solution_str: 1.0, None)
    assert scoring.beside_passes(True, cpu, off_thread)
    assert not scoring.beside_passes(False, gpu, off_thread)
    assert scoring.beside_passes(None, gpu, off_thread) and not scoring.beside_passes(None, cpu, off_thread)
    assert not scoring.beside_passes(True, cpu, main_thread)  # timeout_s: null scores on the main thread
    assert not scoring.beside_passes(True, cpu, None)


# ---------------------------------------------------------------- two ranks (gloo)


def _rank_worker(rank, world, init_file, failing, beside, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        def fn(solution_str):
            if rank == failing:
                raise SystemExit(3)  # the reward's sys.exit: a RewardStopped on this rank
            return 1.0

        reward = weighted(fn)
        samples = scoring.reward_inputs(BATCH, GEN, 0, None)
        try:
            got = scoring.wait(scoring.start(reward, samples)) if beside else scoring.score(reward, samples)
            out[rank] = ("scores", got.tolist())
        except RewardStopped as e:
            out[rank] = ("stopped", str(e), e.exit_code)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("failing, beside", [(1, False), (0, True), (None, False)])
def test_two_ranks_give_up_together(tmp_path, failing, beside):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), failing, beside, out), nprocs=2, join=True)
        out = dict(out)
    if failing is None:
        assert out == {0: ("scores", [1.0, 1.0, 1.0]), 1: ("scores", [1.0, 1.0, 1.0])}
        return
    other = 1 - failing
    assert out[failing][0] == "stopped" and "raised SystemExit" in out[failing][1] and out[failing][2] == 3
    assert out[other] == ("stopped", "another rank stopped in its reward", 0)
