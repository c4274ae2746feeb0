"""Shared-prompt log-probs through the KV cache (models/shared_prefix.py) against a plain float64 forward of
every row; the packed paths are tested in test_packed.py."""

import pytest
import torch

from tiny_models import tiny_model
from verl_fast.models.shared_prefix import prompt_groups, shared_prompt_logprobs


def _batch(vocab, prompt_lens, n, resp_lens, seed=0):
    """Groups of n rows: one left-padded prompt each, then right-padded responses of given lengths."""
    g = torch.Generator().manual_seed(seed)
    P, L = max(prompt_lens), max(resp_lens)
    rows, masks, group = [], [], []
    for k, plen in enumerate(prompt_lens):
        prompt = torch.randint(1, vocab, (plen,), generator=g)
        for j in range(n):
            rlen = resp_lens[(k * n + j) % len(resp_lens)]
            ids = torch.zeros(P + L, dtype=torch.long)
            mask = torch.zeros(P + L, dtype=torch.long)
            ids[P - plen:P], mask[P - plen:P] = prompt, 1
            ids[P:P + rlen], mask[P:P + rlen] = torch.randint(1, vocab, (rlen,), generator=g), 1
            rows.append(ids), masks.append(mask), group.append(k)
    return torch.stack(rows), torch.stack(masks), torch.tensor(group), L


def _reference(model, ids, mask, L, temperature):
    """float64, one row at a time, padding removed: log p(token | everything before it)."""
    model = model.double()
    out = torch.zeros(ids.shape[0], L, dtype=torch.float64)
    for r in range(ids.shape[0]):
        keep = mask[r].bool()
        seq = ids[r][keep][None]
        logits = model(input_ids=seq).logits[0].double() / temperature
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, seq[0, 1:, None])[:, 0]
        n_resp = int(mask[r, -L:].sum())
        out[r, :n_resp] = lp[-n_resp:]
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shared_prompt_matches_plain_forward_and_gradients(family):
    model = tiny_model(family, seed=1)
    ids, mask, group, L = _batch(model.config.vocab_size, [5, 3, 7], 3, [4, 2, 1, 4])
    resp_mask = mask[:, -L:].double()
    groups = prompt_groups(ids, mask, group, L)
    assert groups is not None and groups[0].tolist() == [0, 3, 6]
    lp, ent = shared_prompt_logprobs(model, ids, mask, L, groups, temperature=0.7, with_entropy=True)
    assert lp.dtype == torch.float32 and lp.shape == (9, L) and ent.shape == (9, L)
    weights = torch.randn(ids.shape[0], L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (lp.double() * weights * resp_mask).sum().backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}

    ref_model = tiny_model(family, seed=1)
    ref = _reference(ref_model, ids, mask, L, 0.7)
    torch.testing.assert_close(lp.double() * resp_mask, ref * resp_mask, atol=1e-4, rtol=0)
    (ref * weights * resp_mask).sum().backward()
    for n, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-4, rtol=1e-3, msg=n)


def test_prompt_groups_refuses_rows_that_differ_or_do_not_repeat():
    ids, mask, group, L = _batch(50, [4, 4], 2, [3])
    assert prompt_groups(ids, mask, group, L) is not None
    bad = ids.clone()
    bad[1, -L - 1] += 1  # the second row of group 0 has another prompt token
    assert prompt_groups(bad, mask, group, L) is None
    assert prompt_groups(ids, mask, torch.arange(4), L) is None  # one row per group: nothing to share
