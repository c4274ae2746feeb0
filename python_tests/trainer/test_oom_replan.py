"""An actor update whose passes run out of device memory (trainer/updates.Updates.fitted_step): re-planned once
(gradient checkpointing on, else micro-batches halved), its partial gradients dropped, the step retried and one
line logged; the retried step trains exactly as a step that never failed. The out-of-memory error is injected
into the strategy's passes on the CPU after a first micro-batch has left its gradients."""

import copy
import logging

import pytest
import torch

from support.tiny_models import tiny_model
from verl_fast.config import from_dict
from verl_fast.records.experience import Experience
from verl_fast.strategies.fsdp_strategy import FSDPStrategy
from verl_fast.trainer.updates import Updates

ROWS, PROMPT, RESPONSE = 4, 6, 10


class Perf:
    def count_update(self, tokens, pairs):
        pass


def loss(logp, entropy, sub, counts):
    return -(logp * sub.advantages * sub.response_mask).sum() / counts["num_tokens"], {}


def built(model, checkpointing: bool):
    cfg = from_dict({"actor": {"model_name": "m", "micro_batch_size": 2, "gradient_checkpointing": checkpointing,
                               "lr": 1e-2},
                     "rollout": {"max_new_tokens": RESPONSE, "n": 2},
                     "trainer": {"train_batch_size": 2, "max_prompt_length": PROMPT, "device": "cpu"}})
    strategy = FSDPStrategy(cfg, copy.deepcopy(model), None, None, needs_reference=False)
    return strategy, Updates(cfg, strategy, Perf())


def experience():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 200, (ROWS, PROMPT + RESPONSE), generator=g)
    return Experience(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_index=torch.tensor([0, 0, 1, 1]),
                      response_mask=torch.ones(ROWS, RESPONSE, dtype=torch.long),
                      advantages=torch.randn(ROWS, RESPONSE, generator=g))


def failing(strategy, times: int):
    """The strategy's passes raise torch.OutOfMemoryError ``times`` times, each after its first micro-batch
    has run (its gradients left behind, as a real failure mid-step leaves them); the micro-batches of each
    call are recorded."""
    passes, calls = strategy.forward_backward, []

    def forward_backward(exp, micro, loss_fn, entropy=True):
        calls.append([len(idx) for idx in micro])
        if len(calls) <= times:
            passes(exp, micro[:1], loss_fn, entropy)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return passes(exp, micro, loss_fn, entropy)

    strategy.forward_backward = forward_backward
    return calls


@pytest.fixture
def model():
    return tiny_model("qwen2", vocab_size=200)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["checkpointing-on", "micro-batches-halved"])
def test_an_out_of_memory_step_is_replanned_retried_and_trains_as_a_clean_one(model, checkpointing, caplog):
    clean, clean_updates = built(model, checkpointing)
    # a step that never failed, at the re-plan's micro-batches (AdamW's first step is near the gradient's sign:
    # another summation order of the same gradient moves a parameter whose gradient is near zero otherwise)
    clean_updates.split = 2 if checkpointing else 1
    clean_updates.actor(experience(), loss, skip_idle=False, step=0)

    strategy, updates = built(model, checkpointing)
    calls = failing(strategy, times=1)
    assert updates.budget_metrics()["perf/update_replanned"] == 0.0
    with caplog.at_level(logging.WARNING, logger="verl_fast.trainer.updates"):
        out = updates.actor(experience(), loss, skip_idle=False, step=0)
    assert out["perf/update_replanned"] == 1.0  # the step's metrics say so, not only the log
    lines = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(lines) == 1 and "retrying the step" in lines[0]
    if checkpointing:  # on already: the micro-batches halve
        assert calls == [[2, 2], [1, 1, 1, 1]] and "half the budget" in lines[0]
    else:
        assert calls == [[2, 2], [2, 2]] and "gradient checkpointing on" in lines[0]
        assert strategy.checkpointing and strategy.actor.model.gradient_checkpointing
    for (name, want), got in zip(clean.actor.named_parameters(), strategy.actor.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)  # the failed pass's gradients dropped


def test_a_second_out_of_memory_step_raises_naming_what_is_left(model):
    strategy, updates = built(model, checkpointing=False)
    failing(strategy, times=2)
    with pytest.raises(torch.OutOfMemoryError, match="no safer plan left: re-planned once already"):
        updates.actor(experience(), loss, skip_idle=False, step=0)


def test_one_row_a_micro_batch_recomputed_has_no_safer_plan(model):
    strategy, updates = built(model, checkpointing=True)
    updates.split = 2  # one row a micro-batch already
    failing(strategy, times=1)
    with pytest.raises(torch.OutOfMemoryError, match="one row a micro-batch, activations recomputed"):
        updates.actor(experience(), loss, skip_idle=False, step=0)


def test_an_out_of_memory_optimizer_step_is_not_retried(model):
    """Only the passes are retried: an optimiser step that failed part-way has moved some of its states."""
    strategy, updates = built(model, checkpointing=False)
    steps = []

    def optimizer_step():
        steps.append(True)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    strategy.optimizer_step = optimizer_step
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 1.00 GiB"):
        updates.actor(experience(), loss, skip_idle=False, step=0)
    assert steps == [True] and not updates.replanned


def test_a_strategy_without_a_re_plan_raises(model):
    """Megatron's strategy (no ``recompute_activations``): its ranks and gradient buffers are not re-planned."""
    strategy, updates = built(model, checkpointing=False)
    failing(strategy, times=1)
    strategy.recompute_activations = None  # as Megatron's strategy: it has none
    with pytest.raises(torch.OutOfMemoryError, match="re-plans only at start-up"):
        updates.actor(experience(), loss, skip_idle=False, step=0)
    assert not updates.replanned
