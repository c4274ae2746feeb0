"""The trainer's batching (trainer/batching.py): micro-batches by count or under a token budget, and
losses normalised by the whole batch's counts, so that gradient accumulation equals the gradient of
one big batch (one process, and two data-parallel ranks over gloo)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tiny_models import tiny_model
from verl_fast.algos.loss_terms import agg_loss
from verl_fast.trainer.batching import loss_normalisers, micro_batches

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


def per_token_loss(net, x, y):
    return (net(x).squeeze(-1) - y) ** 2


def grads(net):
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def full_batch_grad(x, y, mask, mode):
    net = model()
    agg_loss(per_token_loss(net, x, y), mask, mode).backward()
    return grads(net)


def accumulated_grad(x, y, mask, mode, mbs, counts):
    net = model()
    for idx in mbs:
        agg_loss(per_token_loss(net, x[idx], y[idx]), mask[idx], mode, **counts).backward()
    return grads(net)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_normalised_accumulation_equals_one_big_batch(mode):
    x, y, tokens, mask = make_batch(0)
    rows = torch.arange(len(tokens))
    mbs = micro_batches(rows, tokens, max_tokens=160)
    sizes = [len(i) for i in mbs]
    assert len(mbs) >= 4 and len(set(sizes)) > 1, "micro-batches of different sizes"
    assert all(len(i) * int(tokens[i].max()) <= 160 for i in mbs), "padded micro-batches within the budget"
    assert sorted(torch.cat(mbs).tolist()) == rows.tolist()
    ref = full_batch_grad(x, y, mask, mode)
    ours = accumulated_grad(x, y, mask, mode, mbs, loss_normalisers(mask))
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)  # float64, summation order
    if mode == "token-mean":  # averaging micro-batch means is not exact: the test can tell the difference
        net = model()
        for idx in mbs:
            (agg_loss(per_token_loss(net, x[idx], y[idx]), mask[idx], mode) / len(mbs)).backward()
        assert (grads(net) - ref).abs().max() > 1e-3


def test_micro_batches_by_count():
    rows = torch.arange(10, 20)
    assert [m.tolist() for m in micro_batches(rows, size=4)] == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19]]
    assert micro_batches(rows[:0], torch.ones(10), max_tokens=8) == []


def test_bad_input():
    rows = torch.arange(3)
    with pytest.raises(ValueError, match="exactly one of size"):
        micro_batches(rows)
    with pytest.raises(ValueError, match="exactly one of size"):
        micro_batches(rows, torch.ones(3), size=2, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        micro_batches(rows, torch.tensor([3, 4, 5]), max_tokens=0)


# ---------------------------------------------------------------- two data-parallel ranks (gloo)


def _dp_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Rank 1's sequences are longer, so on its own it needs more micro-batches.
        data = [make_batch(10 + r, B=24 + 8 * r, T=40 + 40 * r) for r in range(world)]
        x, y, tokens, mask = data[rank]
        rows = torch.arange(len(tokens))
        mine = micro_batches(rows, tokens, max_tokens=400)
        mbs = micro_batches(rows, tokens, max_tokens=400, group=dist.group.WORLD)
        counts = [None] * world
        dist.all_gather_object(counts, (len(mine), len(mbs)))
        assert counts[0][0] != counts[1][0], "the ranks need different counts on their own"
        assert len({c[1] for c in counts}) == 1, "with a group every rank runs the same count"
        g = accumulated_grad(x, y, mask, "token-mean", mbs, loss_normalisers(mask, dist.group.WORLD))
        dist.all_reduce(g)
        g /= world  # what FSDP / DDP do: average over ranks
        # Reference: the token-mean loss over every rank's data at once, in one process.
        ref_net = model()
        num = sum((per_token_loss(ref_net, xr, yr) * mr).sum() for xr, yr, _, mr in data)
        (num / sum(mr.sum() for *_, mr in data)).backward()
        torch.testing.assert_close(g, grads(ref_net), rtol=1e-10, atol=1e-10)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_agree_on_count_and_match_the_global_token_mean_gradient(tmp_path):
    mp.spawn(_dp_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


# ---------------------------------------------------------------- the token budget's auto


def test_auto_token_budget_counts_free_memory_less_what_the_update_will_allocate(monkeypatch):
    from verl_fast.strategies import memory_plan
    from verl_fast.trainer import batching

    model = tiny_model("qwen2", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shape = memory_plan.shape_of(model)
    per_token = memory_plan.activation_bytes(shape, 2, compiled=True, checkpointed=False)
    params = sum(p.numel() for p in model.parameters())
    cuda = torch.device("cuda")
    free = 8 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def fraction(value):  # torch's getter refuses a device without an index ("cuda"): so does this one
        return lambda device: value if device.index is not None else pytest.fail(f"no index: {device}")

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction(1.0))  # no cap
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2**20)  # 2 MiB cached, free to reuse
    fresh = batching.token_budget(model, optimizer, cuda, compiled=True, half=True)
    # gradients (fp32, as the parameters) and AdamW's two fp32 moments are still to come
    assert fresh == int(batching.MEMORY_FRACTION * (free + 2 * 2**20 - 12 * params) / per_token)
    model(torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
    optimizer.step()
    stepped = batching.token_budget(model, optimizer, cuda, compiled=True, half=True)
    assert stepped == int(batching.MEMORY_FRACTION * (free + 2 * 2**20) / per_token)
    # eager norms and MLPs keep more per token, float32 activations twice as much; checkpointed, far less
    eager32 = memory_plan.activation_bytes(shape, 4, compiled=False, checkpointed=False)
    assert eager32 > 2 * per_token
    assert batching.token_budget(model, optimizer, cuda, compiled=False, half=False) == \
        int(batching.MEMORY_FRACTION * (free + 2 * 2**20) / eager32)
    assert batching.token_budget(model, optimizer, cuda, compiled=True, half=True, checkpointed=True) == \
        int(batching.MEMORY_FRACTION * (free + 2 * 2**20) / memory_plan.activation_bytes(shape, 2, True, True))
    # a per-process cap (set_per_process_memory_fraction): what the cap leaves beyond the reserved 3 MiB
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction(0.25))
    assert batching.token_budget(model, optimizer, cuda, compiled=True, half=True) == \
        int(batching.MEMORY_FRACTION * (0.25 * 2 * free - 3 * 2**20 + 2 * 2**20) / per_token)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction(1.0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 2 * free))
    assert batching.token_budget(model, optimizer, cuda, compiled=True, half=True) == 4096  # the floor
    assert batching.token_budget(model, optimizer, torch.device("cpu"), True, True) == batching.CPU_TOKEN_BUDGET
