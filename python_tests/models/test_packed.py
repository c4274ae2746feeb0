"""Packed sequences (models/packed.py): the layout against a plain loop that writes it out, and the
packed log-probs (varlen sequences; dense mask) against a float64 forward of every row alone."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouped_batches import grouped_batch, row_by_row_logprobs
from tiny_models import tiny_model
from verl_fast.models import packed
from verl_fast.models.shared_prefix import experience_logprobs, prompt_groups


def _written_out(mask, L, groups):
    """The layout as plain lists: per query sequence its tokens (flat source, position) and its keys
    (flat sources, in order); per response token (target, slot, predictor's flat source)."""
    N, W = mask.shape
    P = W - L
    seqs, preds = [], []
    live = [r for r in range(N) if mask[r, P:].sum() > 0]
    cols = lambda r, lo, hi: [r * W + c for c in range(lo, hi) if mask[r, c]]  # noqa: E731
    if groups is None:
        for r in live:
            toks = cols(r, 0, W)
            seqs.append((toks, list(range(len(toks))), toks))
            for j, t in enumerate(cols(r, P, W)):
                preds.append((t, r * L + j, toks[toks.index(t) - 1]))
    else:
        first, row_group = groups
        gl = sorted({int(row_group[r]) for r in live})
        for g in gl:
            prompt = cols(int(first[g]), 0, P)
            seqs.append((prompt, list(range(len(prompt))), prompt))
        for r in live:
            prompt = cols(int(first[row_group[r]]), 0, P)
            resp = cols(r, P, W)
            seqs.append((resp, list(range(len(prompt), len(prompt) + len(resp))), prompt + resp))
            for j, t in enumerate(resp):
                preds.append((t, r * L + j, prompt[-1] if j == 0 else resp[j - 1]))
    return seqs, preds


def _read_back(lay):
    """The layout's sequences as _written_out writes them (the filler, checked here, left out)."""
    cu_q, cu_k = lay.bounds
    src = lay.source.tolist()
    keys = src if lay.k_index is None else [src[i] for i in lay.k_index.tolist()]
    seqs = [(src[a:b], lay.position[a:b].tolist(), keys[c:d])
            for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
    if lay.filler:  # the last sequence: copies of the first token attending themselves, predicting nothing
        q, _, k = seqs.pop()
        assert q == k == [src[0]] * lay.filler and len(src) == packed.bucket(lay.tokens)
        assert lay.predictor.max() < lay.tokens
        assert (lay.group[-lay.filler:] == -2).all() and (lay.owner[-lay.filler:] == -3).all()
    preds = list(zip(lay.target.tolist(), lay.slot.tolist(), [src[i] for i in lay.predictor.tolist()]))
    return seqs, preds


@settings(max_examples=60, deadline=None)
@given(prompt_lens=st.lists(st.integers(1, 6), min_size=1, max_size=4), n=st.integers(1, 4),
       resp_lens=st.lists(st.integers(0, 5), min_size=1, max_size=5), share=st.booleans(), bucketed=st.booleans())
def test_layout_is_the_written_out_sequences(prompt_lens, n, resp_lens, share, bucketed):
    ids, mask, group, L = grouped_batch(50, prompt_lens, n, resp_lens)
    groups = prompt_groups(ids, mask, group, L) if share else None
    lay = packed.layout(mask, L, groups, bucketed=bucketed)
    if mask[:, -L:].sum() == 0:
        assert lay is None  # nothing to predict
        return
    seqs, preds = _read_back(lay)
    want_seqs, want_preds = _written_out(mask, L, groups)
    assert seqs == want_seqs and preds == want_preds
    # FLOP count: every query attends its sequence's keys up to its own position
    assert lay.pairs == sum(sum(len(k) - len(q) + i + 1 for i in range(len(q))) for q, _, k in seqs)
    # the dense mask says what the sequences say (the filler sees only itself)
    dense = packed.dense_mask(lay)
    if lay.filler:
        assert not dense[-lay.filler:, : lay.tokens].any() and not dense[: lay.tokens, lay.tokens:].any()
        dense = dense[: lay.tokens, : lay.tokens]
    src = lay.source.tolist()[: lay.tokens]
    for q, pos, k in seqs:
        for i, (t, p) in enumerate(zip(q, pos)):
            sees = {src[j] for j in dense[src.index(t)].nonzero()[:, 0].tolist()}
            assert sees == set(k[: len(k) - len(q) + i + 1])


@pytest.mark.parametrize("tokens,want", [(1, 128), (128, 128), (129, 256), (4095, 4096), (4097, 4352),
                                         (33000, 34816), (65536, 65536)])
def test_bucket_sizes(tokens, want):
    assert packed.bucket(tokens) == want and (want - tokens) <= max(127, tokens // 16)


def test_bucketed_layout_gives_the_same_logprobs_and_gradients():
    """The filler sequence changes nothing the real tokens compute (the varlen reference on the CPU)."""
    ids, mask, group, L = grouped_batch(320, [5, 3, 7], 3, [4, 2, 0, 5])
    runs = []
    for bucketed in (False, True):
        model = tiny_model("qwen2", seed=4)
        lay = packed.layout(mask, L, prompt_groups(ids, mask, group, L), bucketed=bucketed)
        assert bool(lay.filler) == bucketed
        with packed.attention_switched(model):
            lp, ent = packed.packed_logprobs(model, ids, lay, L, with_entropy=True)
            (lp.sum() + ent.sum()).backward()
        runs.append((lp.detach(), ent.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-6, rtol=1e-6)
    for a, b in zip(runs[0][2], runs[1][2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_one_long_sequence_is_a_single_self_attending_sequence_past_the_threshold(monkeypatch):
    monkeypatch.setattr(packed, "LONG_SEQUENCE", 6)
    one = grouped_batch(50, [4], 1, [5])
    two = grouped_batch(50, [4], 2, [5, 3])
    short = grouped_batch(50, [2], 1, [3])
    lay = lambda b, share=False, bucketed=False: packed.layout(  # noqa: E731
        b[1], b[3], prompt_groups(b[0], b[1], b[2], b[3]) if share else None, bucketed=bucketed)
    assert packed.one_long_sequence(lay(one)) and packed.one_long_sequence(lay(one, bucketed=True))
    assert packed.one_long_sequence(lay(one, share=True))  # a group of one row: its prompt is not split off
    assert not packed.one_long_sequence(lay(two)) and not packed.one_long_sequence(lay(two, share=True))
    assert not packed.one_long_sequence(lay(short))


def test_the_dense_causal_call_gives_the_sequences_attention_with_grouped_heads_and_a_filler():
    """float64, the math backend: the real tokens' outputs are the per-sequence reference's (the filler's
    own outputs are not used)."""
    from torch.nn.attention import SDPBackend

    ids, mask, _, L = grouped_batch(50, [7], 1, [9])
    lay = packed.layout(mask, L, bucketed=True)
    assert lay.filler
    T = lay.source.numel()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, heads, 8, generator=g, dtype=torch.float64) for heads in (4, 2, 2))
    got = packed._dense_causal(q, k, v, lay, 0.3, backends=[SDPBackend.MATH])
    want = packed._reference(q, k, v, lay, 0.3)
    torch.testing.assert_close(got[: lay.tokens], want[: lay.tokens], atol=1e-12, rtol=0)


def test_a_long_sequence_takes_the_dense_call_in_the_models_forward_and_backward(monkeypatch):
    """The dispatch: a one-sequence micro-batch past the threshold attends through ``_dense_causal`` (the
    varlen call not made), with the log-probs and gradients of the per-sequence path."""
    from torch.nn.attention import SDPBackend

    ids, mask, group, L = grouped_batch(320, [6], 1, [9])
    lay = packed.layout(mask, L, bucketed=True)
    runs = []
    for dense in (False, True):
        model = tiny_model("qwen2", seed=4)
        if dense:
            monkeypatch.setattr(packed, "LONG_SEQUENCE", 8)
            monkeypatch.setattr(packed, "flash_available", lambda *a: True)
            monkeypatch.setattr(packed, "_flash", lambda *a: pytest.fail("the varlen call was made"))
            monkeypatch.setattr(packed, "_long_backends", lambda: ([SDPBackend.MATH], {}))
        with packed.attention_switched(model):
            lp, _ = packed.packed_logprobs(model, ids, lay, L)
            lp.sum().backward()
        runs.append((lp.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_layout_refuses_holes_empty_prompts_and_large_batches():
    ids, mask, group, L = grouped_batch(50, [5, 3], 2, [4, 2])
    assert packed.layout(mask, L) is not None
    holed = mask.clone()
    holed[0, -L + 1] = 0  # a response token missing between two others
    assert packed.layout(holed, L) is None
    no_prompt = mask.clone()
    no_prompt[1, : -L] = 0  # a response with nothing before it
    assert packed.layout(no_prompt, L) is None
    groups = prompt_groups(ids, mask, group, L)
    total = 8 + int(mask[:, -L:].sum())  # the two prompts once, every response token
    assert packed.layout(mask, L, groups, max_tokens=total - 1) is None
    assert packed.layout(mask, L, groups, max_tokens=total).tokens == total


@pytest.mark.parametrize("family,share,fused", [("llama", True, False), ("qwen2", True, True),
                                                ("qwen2", False, False), ("qwen3", True, False)])
def test_varlen_matches_the_float64_forward_and_gradients(family, share, fused):
    """The varlen sequences (on the CPU: one sdpa call per sequence) through the model's own layers:
    the float64 reference's log-probs and gradients, zeros past each response's end, the plain
    forward's entropies; responses of length 0 and groups of one row included."""
    model = tiny_model(family, seed=1)
    ids, mask, group, L = grouped_batch(model.config.vocab_size, [5, 3, 7, 2], 3, [4, 2, 0, 1, 4, 3])
    group[-1] = 9  # the last row alone in its group
    resp_mask = mask[:, -L:].double()
    with packed.attention_switched(model):
        lp, ent = experience_logprobs(model, ids, mask, L, group, temperature=0.7, with_entropy=True,
                                      fused=fused, share=share, packed=True)
        assert model.config._attn_implementation == packed.ATTENTION
    assert model.config._attn_implementation == "sdpa" and not hasattr(model.config, "_verl_fast_attention")
    assert lp.dtype == torch.float32 and lp.shape == (12, L) and ent.shape == (12, L)
    assert (lp[resp_mask == 0] == 0).all() and (ent[resp_mask == 0] == 0).all()
    weights = torch.randn(ids.shape[0], L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (lp.double() * weights).sum().backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}

    ref_model = tiny_model(family, seed=1)
    ref = row_by_row_logprobs(ref_model, ids, mask, L, 0.7)
    torch.testing.assert_close(lp.double(), ref * resp_mask, atol=1e-4, rtol=0)
    (ref * weights * resp_mask).sum().backward()
    for n, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-4, rtol=1e-3, msg=n)
    _, plain_ent = experience_logprobs(tiny_model(family, seed=1), ids, mask, L, group, temperature=0.7,
                                       with_entropy=True, fused=False, share=False)
    torch.testing.assert_close(ent, plain_ent * resp_mask.float(), atol=1e-4, rtol=1e-4)


def test_a_peft_lora_model_packs_and_matches_the_float64_forward():
    """A LoRA actor (peft's wrapper) takes the packed layout as the model it wraps does, and its packed
    log-probs and adapter gradients are the float64 forward's of every row alone."""
    peft = pytest.importorskip("peft")
    from verl_fast.models.shared_prefix import packed_layout

    def lora_model():
        return peft.get_peft_model(tiny_model("qwen2", seed=1),
                                   peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))

    model = lora_model()
    ids, mask, group, L = grouped_batch(model.config.vocab_size, [5, 3, 7], 2, [4, 2, 0, 1, 4, 3])
    assert packed_layout(model, ids, mask, L, group, False) is not None  # it was None: peft names no logits_to_keep
    with packed.attention_switched(model):
        lp, _ = experience_logprobs(model, ids, mask, L, group, share=False, packed=True, fused=False)
    resp_mask = mask[:, -L:].double()
    weights = torch.randn(ids.shape[0], L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (lp.double() * weights).sum().backward()
    ref_model = lora_model()
    ref = row_by_row_logprobs(ref_model, ids, mask, L, 1.0)
    torch.testing.assert_close(lp.double(), ref * resp_mask, atol=1e-4, rtol=0)
    (ref * weights * resp_mask).sum().backward()
    want = dict(ref_model.named_parameters())
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for _, p in trained)
    for n, p in trained:
        torch.testing.assert_close(p.grad.double(), want[n].grad, atol=1e-4, rtol=1e-3, msg=n)


@pytest.mark.parametrize("family,attention", [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_dense_matches_the_float64_forward_and_gradients(family, attention):
    """The CPU's small-batch path: every group's prompt and responses in one sequence under a
    [T, T] mask through the model's own attention."""
    model = tiny_model(family, seed=1)
    model.config._attn_implementation = attention
    ids, mask, group, L = grouped_batch(model.config.vocab_size, [5, 3, 7], 3, [4, 2, 1, 4, 3])
    resp_mask = mask[:, -L:].double()
    lay = packed.layout(mask, L, prompt_groups(ids, mask, group, L), max_tokens=packed.DENSE_MAX_TOKENS)
    assert lay.tokens == 15 + int(resp_mask.sum())
    lp, _ = packed.packed_logprobs(model, ids, lay, L, temperature=0.7, attention="dense")
    weights = torch.randn(ids.shape[0], L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (lp.double() * weights).sum().backward()
    ref_model = tiny_model(family, seed=1)
    ref = row_by_row_logprobs(ref_model, ids, mask, L, 0.7)
    torch.testing.assert_close(lp.double(), ref * resp_mask, atol=1e-4, rtol=0)
    (ref * weights * resp_mask).sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, atol=1e-4, rtol=1e-3, msg=n)


def test_unpacked_calls_under_the_switch_use_the_models_own_attention():
    """A batch that cannot be packed (a hole) takes the padded forward inside the switch: the same
    log-probs as outside it (masks and attention from the model's own implementation)."""
    model = tiny_model("qwen2", seed=1)
    ids, mask, group, L = grouped_batch(model.config.vocab_size, [5, 3], 2, [4, 2])
    mask[0, -L + 1] = 0
    with torch.no_grad():
        want, _ = experience_logprobs(model, ids, mask, L, group, fused=False, share=False)
        with packed.attention_switched(model):
            got, _ = experience_logprobs(model, ids, mask, L, group, fused=False, packed=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_gradient_checkpointing_recomputes_through_the_varlen_sequences():
    """Recomputed layers look their attention up again in the backward: held over the backward,
    the switch gives the gradients of the run without checkpointing."""
    ids, mask, group, L = grouped_batch(320, [5, 3, 4], 2, [4, 2, 3])
    grads = []
    for checkpointing in (False, True):
        model = tiny_model("llama", seed=2).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with packed.attention_switched(model):
            lp, _ = experience_logprobs(model, ids, mask, L, group, fused=False, packed=True)
            lp.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("share", [True, False])
def test_flash_varlen_on_cuda_matches_the_float32_forward(share):
    """torch's varlen flash kernel under bf16 autocast, as the trainer runs it (grouped KV heads, a
    group's prompt gathered for each response, the bucket's filler): the packed rows give what the same
    kernel gives each row packed alone (a packing that let sequences see each other, misplaced a
    position or lost a shared prompt's gradient would not), and both are within bf16 error of the
    float32 forward: log-probs and every parameter's gradient. (Gradients of two bf16 kernels are not
    compared to each other: the flash kernel's were 1.6-2.5x further from float32 than sdpa's on the
    H200, 4% of the gradient's norm at most.)"""
    assert packed.flash_available(torch.device("cuda"), torch.bfloat16)
    model = tiny_model("qwen2", seed=1, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    ids, mask, group, L = grouped_batch(model.config.vocab_size, [5, 3, 7, 40], 4, [4, 2, 0, 1, 60, 3])
    resp = mask[:, -L:].bool()
    want, _ = experience_logprobs(model, ids, mask, L, group, fused=False, share=False)
    (want * resp).sum().backward()
    truth = [p.grad.clone() for p in model.parameters()]
    model, ids, mask, group, resp = model.cuda(), ids.cuda(), mask.cuda(), group.cuda(), resp.cuda()

    def bf16(calls):
        """Log-probs [N, L] and parameter gradients of the rows, one packed call per index tensor."""
        model.zero_grad()
        out = torch.zeros(resp.shape, dtype=torch.float32)
        for rows in calls:
            with torch.autocast("cuda", dtype=torch.bfloat16), packed.attention_switched(model):
                got, ent = experience_logprobs(model, ids[rows], mask[rows], L, group[rows], with_entropy=True,
                                               share=share, packed=True)
                (got * resp[rows]).sum().backward()
            assert (got[~resp[rows]] == 0).all() and (ent[~resp[rows]] == 0).all()
            out[rows.cpu()] = got.detach().float().cpu()
        return out, [p.grad.float().cpu() for p in model.parameters()]

    together = bf16([torch.arange(ids.shape[0], device="cuda")])
    alone = bf16([torch.tensor([r], device="cuda") for r in range(ids.shape[0]) if resp[r].any()])
    torch.testing.assert_close(together[0], want.detach() * resp.cpu(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(together[0], alone[0], atol=0.02, rtol=0)
    for (name, _), true, grad, grad_alone in zip(model.named_parameters(), truth, together[1], alone[1]):
        apart, off = float((grad - grad_alone).norm() / true.norm()), float((grad - true).norm() / true.norm())
        assert apart <= 0.05 and off <= 0.1, (name, apart, off)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_long_sequence_on_cuda_attends_through_the_dense_call_as_the_varlen_kernel_does(monkeypatch):
    """One sequence past ``LONG_SEQUENCE`` under bf16 autocast (grouped KV heads, the bucket's filler): the
    dense causal call (cuDNN first) gives the log-probs and gradients the varlen flash kernel gives, within
    bf16 error of each other and of the float32 forward."""
    model = tiny_model("qwen2", seed=1, hidden_size=128, num_attention_heads=4, num_key_value_heads=2).cuda()
    ids, mask, _, L = grouped_batch(model.config.vocab_size, [300], 1, [packed.LONG_SEQUENCE])
    ids, mask = ids.cuda(), mask.cuda()
    lay = packed.layout(mask, L, bucketed=True)
    assert packed.one_long_sequence(lay) and lay.filler

    def run(autocast, dense):
        model.zero_grad()
        monkeypatch.setattr(packed, "LONG_SEQUENCE", packed.LONG_SEQUENCE if dense else 1 << 40)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), packed.attention_switched(model):
            lp, _ = packed.packed_logprobs(model, ids, lay, L)
            lp.float().sum().backward()
        return lp.detach().float().cpu(), [p.grad.float().cpu() for p in model.parameters()]

    truth, dense, varlen = run(False, False), run(True, True), run(True, False)
    torch.testing.assert_close(dense[0], varlen[0], atol=0.03, rtol=0)
    torch.testing.assert_close(dense[0], truth[0], atol=0.06, rtol=0.02)
    for (name, _), true, a, b in zip(model.named_parameters(), truth[1], dense[1], varlen[1]):
        assert float((a - b).norm() / true.norm()) <= 0.05 and float((a - true).norm() / true.norm()) <= 0.1, name
