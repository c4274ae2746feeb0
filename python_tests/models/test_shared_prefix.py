"""Shared-prompt log-probs (models/shared_prefix.py) against a plain float64 forward of every row."""

import pytest
import torch

from tiny_models import tiny_model
from verl_fast.models.shared_prefix import packed_layout, packed_prompt_logprobs, prompt_groups, shared_prompt_logprobs


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


@pytest.mark.parametrize("family,attention", [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_packed_matches_plain_forward_and_gradients(family, attention):
    """Every group's prompt and responses in one sequence (padding removed, a 4-D mask): the
    float64 reference's log-probs, entropies' shape and gradients; zeros past each response's end."""
    model = tiny_model(family, seed=1)
    model.config._attn_implementation = attention
    ids, mask, group, L = _batch(model.config.vocab_size, [5, 3, 7], 3, [4, 2, 1, 4, 3])
    resp_mask = mask[:, -L:].double()
    layout = packed_layout(mask, L, prompt_groups(ids, mask, group, L))
    assert layout is not None and layout[0].numel() == 15 + int(resp_mask.sum())
    lp, ent = packed_prompt_logprobs(model, ids, layout, L, temperature=0.7, with_entropy=True)
    assert lp.dtype == torch.float32 and lp.shape == (9, L) and ent.shape == (9, L)
    assert (lp[resp_mask == 0] == 0).all() and (ent[resp_mask == 0] == 0).all()
    weights = torch.randn(ids.shape[0], L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (lp.double() * weights).sum().backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}

    ref_model = tiny_model(family, seed=1)
    ref = _reference(ref_model, ids, mask, L, 0.7)
    torch.testing.assert_close(lp.double(), ref * resp_mask, atol=1e-4, rtol=0)
    (ref * weights * resp_mask).sum().backward()
    for n, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-4, rtol=1e-3, msg=n)
    plain, plain_ent = shared_prompt_logprobs(tiny_model(family, seed=1), ids, mask, L,
                                              prompt_groups(ids, mask, group, L), 0.7, with_entropy=True)
    torch.testing.assert_close(ent, plain_ent * resp_mask.float(), atol=1e-4, rtol=1e-4)


def test_packed_layout_refuses_holes_and_large_batches(monkeypatch):
    from verl_fast.models import shared_prefix

    ids, mask, group, L = _batch(50, [5, 3], 2, [4, 2])
    groups = prompt_groups(ids, mask, group, L)
    holed = mask.clone()
    holed[0, -L + 1] = 0  # a response token missing between two others
    assert packed_layout(holed, L, groups) is None
    monkeypatch.setattr(shared_prefix, "PACKED_MAX_TOKENS", 8 + int(mask[:, -L:].sum()) - 1)
    assert packed_layout(mask, L, groups) is None
    monkeypatch.setattr(shared_prefix, "PACKED_MAX_TOKENS", 8 + int(mask[:, -L:].sum()))
    assert packed_layout(mask, L, groups) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_on_cuda_matches_the_cpu_path():
    """The packed forward on the GPU (SDPA with the 4-D boolean mask, under bf16 autocast as the
    trainer runs it): the CPU float32 log-probs within bf16 rounding, zeros past each response."""
    model = tiny_model("qwen2", seed=1)
    ids, mask, group, L = _batch(model.config.vocab_size, [5, 3, 7], 3, [4, 2, 1, 4, 3])
    groups = prompt_groups(ids, mask, group, L)
    want, _ = packed_prompt_logprobs(model, ids, packed_layout(mask, L, groups), L)
    model, ids, mask, group = model.cuda(), ids.cuda(), mask.cuda(), group.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, ent = packed_prompt_logprobs(model, ids, packed_layout(mask, L, prompt_groups(ids, mask, group, L)), L,
                                          with_entropy=True)
    resp = mask[:, -L:].bool()
    assert (got[~resp] == 0).all() and (ent[~resp] == 0).all()
    torch.testing.assert_close(got.cpu(), want, atol=0.05, rtol=0.02)
