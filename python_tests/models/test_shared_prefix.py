"""Shared-prompt log-probs through the KV cache (models/shared_prefix.py) against a plain float64 forward of
every row; the packed paths are tested in test_packed.py."""

import pytest
import torch

from grouped_batches import grouped_batch, row_by_row_logprobs
from tiny_models import tiny_model
from verl_fast.models.shared_prefix import prompt_groups, shared_prompt_logprobs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shared_prompt_matches_plain_forward_and_gradients(family):
    model = tiny_model(family, seed=1)
    ids, mask, group, L = grouped_batch(model.config.vocab_size, [5, 3, 7], 3, [4, 2, 1, 4])
    resp_mask = mask[:, -L:].double()
    groups = prompt_groups(ids, mask, group, L)
    assert groups is not None and groups[0].tolist() == [0, 3, 6]
    lp, ent = shared_prompt_logprobs(model, ids, mask, L, groups, temperature=0.7, with_entropy=True)
    assert lp.dtype == torch.float32 and lp.shape == (9, L) and ent.shape == (9, L)
    weights = torch.randn(ids.shape[0], L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (lp.double() * weights * resp_mask).sum().backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}

    ref_model = tiny_model(family, seed=1)
    ref = row_by_row_logprobs(ref_model, ids, mask, L, 0.7)
    torch.testing.assert_close(lp.double() * resp_mask, ref * resp_mask, atol=1e-4, rtol=0)
    (ref * weights * resp_mask).sum().backward()
    for n, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-4, rtol=1e-3, msg=n)


def test_prompt_groups_refuses_rows_that_differ_or_do_not_repeat():
    ids, mask, group, L = grouped_batch(50, [4, 4], 2, [3])
    assert prompt_groups(ids, mask, group, L) is not None
    bad = ids.clone()
    bad[1, -L - 1] += 1  # the second row of group 0 has another prompt token
    assert prompt_groups(bad, mask, group, L) is None
    assert prompt_groups(ids, mask, torch.arange(4), L) is None  # one row per group: nothing to share
