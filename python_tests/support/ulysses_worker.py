"""Workers of test_ulysses.py: each of two gloo ranks runs the sequence-parallel log-prob pass of a tiny
model on the same rows and compares its log-probs and its group-summed gradients with the unsharded pass
run in the same process (``response_logprobs``, the plain head)."""

import os
import traceback

import torch
import torch.distributed as dist

from tiny_models import build_model


def rows(batch: int, total: int, response: int, vocab: int, seed: int):
    """Left-padded prompts of several lengths, then responses right-padded at several lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, total), generator=g)
    mask = torch.ones(batch, total, dtype=torch.long)
    prompt = total - response
    for b in range(batch):
        pad_left = int(torch.randint(0, prompt - 1, (1,), generator=g))
        keep = int(torch.randint(1, response + 1, (1,), generator=g))
        mask[b, :pad_left] = 0
        mask[b, prompt + keep:] = 0
    ids[mask == 0] = 0
    return ids, mask


def case(rank: int, world: int, port: int, family: str, kv_heads: int, total: int, out) -> None:
    try:
        from verl_fast.models.response_logprobs import response_logprobs
        from verl_fast.models.ulysses import sequence_parallel, ulysses_logprobs

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.manual_seed(0)
        model = build_model(family, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=kv_heads,
                            intermediate_size=96)
        response = 7
        ids, mask = rows(3, total, response, 512, seed=1)
        valid = mask[:, -response:].bool()  # the loss, as the trainer's, over the response tokens only
        weights = torch.randn(3, response, generator=torch.Generator().manual_seed(2)) * valid

        want, _ = response_logprobs(model, ids, mask, response, temperature=0.7, fused=False)
        (want * weights).sum().backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()

        with sequence_parallel(model):
            got = ulysses_logprobs(model, ids, mask, response, dist.group.WORLD, temperature=0.7)
            (got * weights).sum().backward()
        for p in model.parameters():  # each rank's part of the gradient: the group's sum is the whole
            dist.all_reduce(p.grad)
        assert got.shape == want.shape, (got.shape, want.shape)
        torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-5)  # float32 log-probs
        diffs = {n: float((p.grad - want_grads[n]).abs().max() / want_grads[n].abs().max().clamp(min=1e-12))
                 for n, p in model.named_parameters()}
        assert max(diffs.values()) < 1e-4, diffs
        out[rank] = "ok"
    except Exception:
        out[rank] = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
