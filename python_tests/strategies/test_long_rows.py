"""The update on rows longer than the model's positions and than the packed dense mask's limit, through the
strategy as the trainer drives it (FSDPStrategy: the packed varlen attention, gradient checkpointing, the
fused log-prob head; full fine-tune and LoRA), against a float64 plain forward of the same rows: the code
path of the 65,536-token Qwen3 row of benchmarks/bench_long_caps.py, at a size the CPU runs."""

import copy

import pytest
import torch

from support.tiny_models import tiny_model
from verl_fast.config import from_dict
from verl_fast.models import lora as lora_mod
from verl_fast.models.packed import DENSE_MAX_TOKENS
from verl_fast.records.experience import Experience
from verl_fast.strategies.fsdp_strategy import FSDPStrategy

POSITIONS = 256  # the model's max_position_embeddings, far below the rows' length
PROMPTS = (48, 33)  # two rows, each its own prompt, ragged responses
RESPONSES = (DENSE_MAX_TOKENS + 300, 250)


def rows(vocab: int):
    g = torch.Generator().manual_seed(1)
    P, L = max(PROMPTS), max(RESPONSES)
    ids = torch.zeros(len(PROMPTS), P + L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (p, n) in enumerate(zip(PROMPTS, RESPONSES)):
        ids[r, P - p:P + n] = torch.randint(1, vocab, (p + n,), generator=g)
        mask[r, P - p:P + n] = 1
    return ids, mask, L


def loss_of(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return -(logp * advantages * mask).sum() / mask.sum()


def reference(model, ids, mask, L, advantages):
    """float64, one row at a time with its padding removed, positions 0..n-1: the loss's log-probs and
    its gradient by parameter name."""
    model = copy.deepcopy(model).double()
    out = torch.zeros(ids.shape[0], L, dtype=torch.float64)
    for r in range(ids.shape[0]):
        n = int(mask[r, -L:].sum())
        seq = ids[r][mask[r].bool()][None]
        logits = model(input_ids=seq, use_cache=False).logits[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, seq[0, 1:, None])[:, 0]
        out[r, :n] = lp[-n:]
    loss_of(out, advantages.double(), mask[:, -L:].double()).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads


@pytest.mark.parametrize("rank", [None, 4], ids=["full", "lora"])
def test_rows_past_the_positions_train_as_the_float64_reference(rank):
    torch.manual_seed(0)
    model = tiny_model("qwen3", max_position_embeddings=POSITIONS)
    actor = {"model_name": "m", "use_remove_padding": True, "gradient_checkpointing": True, "fused_logprobs": "on"}
    if rank:
        actor["lora"] = {"r": rank, "alpha": 2 * rank}
    ids, mask, L = rows(model.config.vocab_size)
    cfg = from_dict({"actor": actor, "rollout": {"max_new_tokens": L, "n": 2},
                     "trainer": {"train_batch_size": 1, "max_prompt_length": max(PROMPTS), "device": "cpu"}})
    if rank:
        model = lora_mod.apply(model, cfg.actor.lora)
        with torch.no_grad():  # adapters away from zero: lora_A's gradient is zero while lora_B is
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1)
    advantages = torch.randn(ids.shape[0], L, generator=torch.Generator().manual_seed(2))
    want_logp, want_grads = reference(model, ids, mask, L, advantages)

    strategy = FSDPStrategy(cfg, model, None, None, needs_reference=False)
    assert strategy.checkpointing and strategy.packs_sequences
    exp = Experience(input_ids=ids, attention_mask=mask, prompt_index=torch.arange(ids.shape[0]),
                     response_mask=mask[:, -L:], advantages=advantages)
    micro = [torch.arange(ids.shape[0])]  # one micro-batch: past the dense mask's tokens, the varlen path
    logp = strategy.actor_logprobs(exp, micro)
    err = (logp.double() - want_logp).abs().max().item()
    assert err < 1e-5, err

    def loss_fn(lp, ent, sub):
        return loss_of(lp, sub.advantages, sub.response_mask), {}

    _, (tokens, _) = strategy.forward_backward(exp, micro, loss_fn, entropy=False)
    assert tokens == sum(PROMPTS) + sum(RESPONSES) > DENSE_MAX_TOKENS
    got = {name: p.grad for name, p in strategy.actor.named_parameters() if p.requires_grad}
    assert got.keys() == want_grads.keys() and len(got) > 0
    for name, g in got.items():
        want = want_grads[name]
        assert g is not None, name
        rel = ((g.double() - want).norm() / want.norm().clamp_min(1e-12)).item()
        assert rel < 1e-4, (name, rel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rank", [None, 16], ids=["full", "lora"])
def test_a_32k_row_on_cuda_trains_within_bf16_error_of_the_float32_forward(rank):
    """The GPU's own path at a long row: bf16 autocast and copies, compiled norms and MLPs, torch's varlen
    flash attention, the Triton fused head, gradient checkpointing; one 32,768-token row (128 times the
    model's positions) and a short one, against the float32 plain forward (sdpa, causal) of each row."""
    torch.manual_seed(0)
    model = tiny_model("qwen3", max_position_embeddings=POSITIONS, hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32).cuda()
    P, lengths = 64, (32768 - 64, 300)
    L = max(lengths)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, model.config.vocab_size, (2, P + L), generator=g)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, : P + n] = 1
    ids, mask = (ids * mask).cuda(), mask.cuda()
    actor = {"model_name": "m", "gradient_checkpointing": True}
    if rank:
        actor["lora"] = {"r": rank, "alpha": 2 * rank}
    cfg = from_dict({"actor": actor, "rollout": {"max_new_tokens": L, "n": 2},
                     "trainer": {"train_batch_size": 1, "max_prompt_length": P, "device": "cuda"}})
    if rank:
        model = lora_mod.apply(model, cfg.actor.lora)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1)
    advantages = torch.randn(2, L, generator=g).cuda()
    ref = copy.deepcopy(model)
    want = torch.zeros(2, L, device="cuda")
    for r, n in enumerate(lengths):
        seq = ids[r, : P + n][None]
        logits = ref(input_ids=seq, use_cache=False).logits[0].float()
        want[r, :n] = torch.log_softmax(logits[:-1], -1).gather(-1, seq[0, 1:, None])[:, 0][-n:]
    loss_of(want, advantages, mask[:, -L:]).backward()
    truth = {name: p.grad for name, p in ref.named_parameters() if p.requires_grad}

    strategy = FSDPStrategy(cfg, model, None, None, needs_reference=False)
    assert strategy.checkpointing and strategy.packs_sequences and strategy.autocast_dtype == torch.bfloat16
    exp = Experience(input_ids=ids, attention_mask=mask, prompt_index=torch.arange(2, device="cuda"),
                     response_mask=mask[:, -L:], advantages=advantages)
    micro = [torch.arange(2, device="cuda")]
    logp = strategy.actor_logprobs(exp, micro)
    torch.testing.assert_close(logp, want.detach() * mask[:, -L:], atol=0.05, rtol=0.02)

    def loss_fn(lp, ent, sub):
        return loss_of(lp, sub.advantages, sub.response_mask), {}

    strategy.forward_backward(exp, micro, loss_fn)
    got = {name: p.grad for name, p in strategy.actor.named_parameters() if p.requires_grad}
    assert got.keys() == truth.keys()
    for name, grad in got.items():
        off = float((grad.float() - truth[name]).norm() / truth[name].norm())
        assert off <= 0.1, (name, off)
