"""The policy-gradient hooks the trainer calls on every step, built from the config: ``select_experience``
(DAPO's dynamic sampling with a fake scored rollout, against the groups and draws written out here) and
``correct_rollout`` (the truncated importance weights, against float64 written here)."""

import pytest
import torch

from verl_fast import config as C
from verl_fast.algos import registry
from verl_fast.algos.algorithm import MorePrompts
from verl_fast.records.experience import Experience

SAMPLES = 2  # per prompt


def experience_of(prompts):
    """A stand-in for the trainer's scored rollout of ``prompts`` (ints): two samples each, whose
    scores differ for an even prompt and tie for an odd one; input_ids name (prompt, sample)."""
    n = len(prompts) * SAMPLES
    ids = torch.tensor([[p, j] for p in prompts for j in range(SAMPLES)])
    scores = torch.tensor([float(j) if p % 2 == 0 else 1.0 for p in prompts for j in range(SAMPLES)])
    return Experience(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(n, 1, dtype=torch.long),
                      prompt_index=torch.arange(len(prompts)).repeat_interleave(SAMPLES), scores=scores)


def algorithm(**section):
    cfg = C.from_dict({"algorithm": {"type": "grpo", **section}, "rollout": {"n": SAMPLES},
                       "trainer": {"train_batch_size": 4, "seed": 7}})
    return registry.build(cfg)


def drawn(items, step, draw, size=4, seed=7):
    """The extra batch the trainer has always drawn: a generator seeded by seed, step and draw."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + draw)
    return [items[j] for j in torch.randint(len(items), (size,), generator=g).tolist()]


@pytest.mark.parametrize("first, max_draws, step", [([1, 3, 5, 7], 6, 2), ([4, 1, 6, 3], 6, 0),
                                                    ([2, 4, 6, 8], 3, 5), ([1, 2, 3, 5], 0, 1),
                                                    ([1, 3, 5, 7], 0, 3)])
def test_dynamic_sampling_keeps_informative_groups_and_tops_them_up(first, max_draws, step):
    items = [1, 3, 5, 7, 9, 11, 0, 2]  # mostly odd: several draws
    asked = []

    def scored_rollout(prompts):
        asked.append(list(prompts))
        return experience_of(prompts)

    alg = algorithm(dynamic_sampling=True, max_extra_draws=max_draws)
    assert alg.scores_decide_rows
    # the plain expectation: each batch's even prompts in order, until 4 (or the draws run out)
    batches, kept, dropped = [first], [], 0
    while True:
        kept += [p for p in batches[-1] if p % 2 == 0]
        dropped += sum(p % 2 for p in batches[-1])
        if len(kept) >= 4 or len(batches) - 1 >= max_draws:
            break
        batches.append(drawn(items, step, len(batches)))
    kept = kept[:4]
    metrics = {}
    if not kept:
        with pytest.raises(RuntimeError, match=rf"scored the same in the step's batch and {max_draws} extra draws"):
            alg.select_experience(experience_of(first), MorePrompts(items, step, scored_rollout), metrics)
        return
    exp = alg.select_experience(experience_of(first), MorePrompts(items, step, scored_rollout), metrics)
    assert asked == batches[1:]
    assert exp.input_ids[:, 0].tolist() == [p for p in kept for _ in range(SAMPLES)]
    assert exp.prompt_index.tolist() == [g for g in range(len(kept)) for _ in range(SAMPLES)]
    assert metrics == {"dynamic_sampling/extra_draws": float(len(batches) - 1),
                       "dynamic_sampling/dropped_groups": float(dropped),
                       "dynamic_sampling/kept_groups": float(len(kept))}


def test_dynamic_sampling_needs_the_dataset_only_to_draw():
    alg = algorithm(dynamic_sampling=True)
    exp = alg.select_experience(experience_of([2, 4, 6, 8]), MorePrompts((), 0, experience_of), {})
    assert exp.num_sequences == 8
    with pytest.raises(RuntimeError, match="draws its extra prompts from the dataset fit\\(\\) trains on"):
        alg.select_experience(experience_of([1, 2, 3, 4]), MorePrompts((), 0, experience_of), {})


def test_without_the_keys_the_hooks_leave_the_experience_as_it_is():
    alg = algorithm()
    assert not alg.scores_decide_rows
    exp, metrics = experience_of([1, 3]), {}
    assert alg.select_experience(exp, MorePrompts((), 0, experience_of), metrics) is exp
    alg.correct_rollout(exp, metrics, "SomeEngine")  # no log-probs needed either
    assert exp.rollout_is_weights is None and metrics == {}
    assert not alg.needs_old_logprobs(exp)


def test_rollout_correction_weights():
    g = torch.Generator().manual_seed(0)
    alg = algorithm(rollout_correction=True, rollout_correction_cap=1.3)
    exp = experience_of([2, 4, 6])
    exp.response_mask = (torch.rand(6, 5, generator=g) > 0.3).long()
    assert not alg.needs_old_logprobs(exp)  # one epoch, one mini-batch: the update's forward is pi_old
    metrics = {}
    with pytest.raises(ValueError, match=r"rollout engine's log-probs of its samples; SomeEngine returned none"):
        alg.correct_rollout(exp, metrics, "SomeEngine")
    exp.rollout_logprobs = -torch.rand(6, 5, generator=g)
    alg.correct_rollout(exp, metrics, "SomeEngine")  # no old log-probs: the update weighs each micro-batch
    assert exp.rollout_is_weights is None and metrics == {}
    exp.old_logprobs = -torch.rand(6, 5, generator=g)
    exp.rollout_logprobs = exp.old_logprobs + 0.5 * torch.randn(6, 5, generator=g)
    alg.correct_rollout(exp, metrics, "SomeEngine")
    mask = exp.response_mask.double()
    raw = torch.exp(exp.old_logprobs.double() - exp.rollout_logprobs.double())
    want = torch.minimum(raw, torch.tensor(1.3, dtype=torch.float64)) * mask
    torch.testing.assert_close(exp.rollout_is_weights.double(), want, rtol=1e-6, atol=1e-6)
    assert metrics["rollout_correction/is_weight_mean"] == pytest.approx(float(want.sum() / mask.sum()), rel=1e-5)
    assert metrics["rollout_correction/is_capped_fraction"] == pytest.approx(
        float(((raw >= 1.3).double() * mask).sum() / mask.sum()), rel=1e-5)
    assert set(metrics) == {f"rollout_correction/{k}" for k in
                            ("is_weight_mean", "is_weight_max", "is_capped_fraction", "mismatch_kl")}
