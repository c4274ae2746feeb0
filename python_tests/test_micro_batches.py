"""Token-budget micro-batches for the trainer: gradient accumulation with token-scaled losses equals
the gradient of one big batch (one process, and two data-parallel ranks over gloo)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_fast.trainer.batching import loss_scales, make_micro_batches

D = 6


def make_batch(seed, B=37, T=48):
    """Features [B, T, D], targets [B, T], a prompt+response layout: prompt_len + response_len <= T."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    y = torch.randn(B, T, generator=g, dtype=torch.float64)
    prompt = torch.randint(1, 16, (B,), generator=g)
    response = torch.randint(1, T - 15, (B,), generator=g)
    pos = torch.arange(T)[None, :]
    response_mask = ((pos >= prompt[:, None]) & (pos < (prompt + response)[:, None])).double()
    return x, y, prompt + response, response_mask


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(D, 1).double()


def token_mean_loss(net, x, y, mask):
    per_token = (net(x).squeeze(-1) - y) ** 2
    return (per_token * mask).sum() / mask.sum()


def seq_mean_token_mean_loss(net, x, y, mask):
    per_token = (net(x).squeeze(-1) - y) ** 2
    return ((per_token * mask).sum(-1) / mask.sum(-1)).mean()


def grads(net):
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def full_batch_grad(loss_fn, x, y, mask):
    net = model()
    loss_fn(net, x, y, mask).backward()
    return grads(net)


def accumulated_grad(loss_fn, x, y, mask, mbs, scales):
    net = model()
    for idx, scale in zip(mbs.indices, scales):
        (loss_fn(net, x[idx], y[idx], mask[idx]) * scale).backward()
    return grads(net)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_token_scaled_accumulation_equals_one_big_batch(layout):
    x, y, tokens, mask = make_batch(0)
    mbs = make_micro_batches(tokens, 160, loss_weights=mask.sum(-1), layout=layout)
    sizes = [len(i) for i in mbs.indices]
    assert len(mbs) >= 4 and len(set(sizes)) > 1, "micro-batches of different sizes"
    assert all(t <= 160 for t in mbs.plan.costs)
    assert sum(mbs.loss_scales) == pytest.approx(1.0)
    ref = full_batch_grad(token_mean_loss, x, y, mask)
    ours = accumulated_grad(token_mean_loss, x, y, mask, mbs, mbs.loss_scales)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    # Scaling by the micro-batch count instead is not exact: the test can tell the difference.
    naive = accumulated_grad(token_mean_loss, x, y, mask, mbs, [1 / len(mbs)] * len(mbs))
    assert (naive - ref).abs().max() > 1e-3


def test_sequence_scaled_accumulation_for_seq_mean_modes():
    x, y, tokens, mask = make_batch(1)
    mbs = make_micro_batches(tokens, 200, loss_weights=torch.ones(len(tokens)))
    ref = full_batch_grad(seq_mean_token_mean_loss, x, y, mask)
    ours = accumulated_grad(seq_mean_token_mean_loss, x, y, mask, mbs, mbs.loss_scales)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


def test_restore_puts_outputs_back_in_batch_order():
    x, _, tokens, _ = make_batch(2)
    mbs = make_micro_batches(tokens.tolist(), 100)
    assert all(isinstance(i, torch.Tensor) and i.dtype == torch.int64 for i in mbs.indices)
    outs = [x[idx].sum(dim=(1, 2)) for idx, _ in mbs]
    torch.testing.assert_close(mbs.restore(outs), x.sum(dim=(1, 2)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one tensor per micro-batch"):
        mbs.restore(outs[:-1])
    with pytest.raises(ValueError, match=r"outputs\[0\] must have"):
        mbs.restore([outs[0][:-1]] + outs[1:])


def test_bad_input():
    with pytest.raises(ValueError, match="loss_weights must hold one weight per sequence"):
        make_micro_batches([3, 4, 5], 10, loss_weights=[1, 2])
    with pytest.raises(ValueError, match="sum to 0"):
        loss_scales([0, 0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        loss_scales([1, -1])
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        make_micro_batches([3, 4], 0)
    with pytest.raises(TypeError, match="lengths must hold integers"):
        make_micro_batches([3.5, 4], 10)


# ---------------------------------------------------------------- two data-parallel ranks (gloo)


def _dp_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Rank 1's sequences are longer, so on its own it needs more micro-batches.
        data = [make_batch(10 + r, B=24 + 8 * r, T=40 + 40 * r) for r in range(world)]
        x, y, tokens, mask = data[rank]
        mine = make_micro_batches(tokens, 150, loss_weights=mask.sum(-1), same_count_across_dp=False)
        mbs = make_micro_batches(tokens, 150, loss_weights=mask.sum(-1), dp_group=dist.group.WORLD)
        counts = [None] * world
        dist.all_gather_object(counts, (len(mine), len(mbs)))
        assert counts[0][0] != counts[1][0], "the ranks need different counts on their own"
        assert len({c[1] for c in counts}) == 1, "dp_group makes every rank run the same count"
        assert all(c <= 150 for c in mbs.plan.costs)
        net = model()
        for idx, scale in mbs:
            (token_mean_loss(net, x[idx], y[idx], mask[idx]) * scale).backward()
        g = grads(net)
        dist.all_reduce(g)
        g /= world  # what FSDP / DDP do: average over ranks
        # Reference: the token-mean loss over every rank's data at once, in one process.
        ref_net = model()
        num = sum(((ref_net(xr).squeeze(-1) - yr) ** 2 * mr).sum() for xr, yr, _, mr in data)
        (num / sum(mr.sum() for *_, mr in data)).backward()
        torch.testing.assert_close(g, grads(ref_net), rtol=0, atol=1e-12)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_agree_on_count_and_match_the_global_token_mean_gradient(tmp_path):
    mp.spawn(_dp_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)
