"""The memory plan's activation count (strategies/memory_plan: ``layer_bytes``, ``activation_bytes``,
``estimate``) against what the passes really hold, on the CPU at small Qwen2 / Qwen3 shapes in bf16 (the
GPU passes' dtype), packed rows through a stand-in of the varlen flash kernel that keeps what the kernel
keeps (support/live_bytes.py):

- one decoder layer's saved tensors, read through autograd's saved-tensor hooks, eager and compiled
  (torch.compile's norms and MLPs, as ``actor.compile_blocks`` runs them), against ``layer_bytes``;
- the peak of a whole update pass (forward and backward, the log-prob head included), counted as an
  allocator sees it (``LiveBytes``), plain and gradient-checkpointed, against the estimate's activations
  and head: the estimate is an upper bound at most MARGIN above the counted peak."""

import pytest
import torch

from support.live_bytes import LiveBytes, flash_like, layer_saves
from support.tiny_models import tiny_model
from verl_fast.config import from_dict
from verl_fast.models import compiled_blocks, packed
from verl_fast.strategies import memory_plan
from verl_fast.strategies.fsdp_strategy import passes

MARGIN = 1.25  # the estimate over the counted peak, at most
SHAPES = {"qwen2": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
                        num_hidden_layers=3, vocab_size=256),
          "qwen3": dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        intermediate_size=320, num_hidden_layers=3, vocab_size=256)}


@pytest.fixture
def flash(monkeypatch):
    """The packed passes attend through the flash stand-in, as they do through the kernel on a GPU."""
    monkeypatch.setattr(packed, "_flash", flash_like)
    monkeypatch.setattr(packed, "flash_available", lambda device, dtype: True)


def rows(model, n: int, prompt: int, response: int):
    g = torch.Generator().manual_seed(n * 1000 + response)
    ids = torch.randint(1, model.config.vocab_size, (n, prompt + response), generator=g)
    return ids, packed.layout(torch.ones_like(ids), response)


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_layer_bytes_is_what_a_layer_saves_for_its_backward(flash, family, compiled):
    model = tiny_model(family, dtype=torch.bfloat16, **SHAPES[family]).train()
    ids, lay = rows(model, 2, 40, 200)
    layer = model.model.layers[1]
    with passes(model, compiled, True), layer_saves(model, layer) as saved:
        logp, _ = packed.packed_logprobs(model, ids, lay, 200)
    assert saved
    want = memory_plan.layer_bytes(memory_plan.shape_of(model), 2, compiled) * lay.tokens
    got = float(sum(saved.values()))
    # what the count leaves out: the norms' float32 rsqrt a token (4 bytes each)
    assert abs(got - want) <= 0.03 * want, (got, want)


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("n,prompt,response", [(2, 64, 448), (3, 96, 800)])
def test_the_estimate_bounds_an_update_pass_counted_as_an_allocator_sees_it(flash, family, checkpointing, n,
                                                                            prompt, response):
    model = tiny_model(family, dtype=torch.bfloat16, **SHAPES[family]).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, lay = rows(model, n, prompt, response)

    def update_pass():
        with passes(model, False, True):
            logp, _ = packed.packed_logprobs(model, ids, lay, response, fused=False)
            logp.float().sum().backward()

    update_pass()  # the parameters' gradients exist (the plan counts them in its static bytes)
    with LiveBytes() as live:
        update_pass()
    cfg = from_dict({"actor": {"model_name": "m", "gradient_checkpointing": checkpointing},
                     "rollout": {"max_new_tokens": response, "n": 2},
                     "trainer": {"train_batch_size": n, "max_prompt_length": prompt}})
    est = memory_plan.estimate(cfg, memory_plan.shape_of(model), model.config, 2**40, compiled=False,
                               fused_head=False, micro_tokens=lay.tokens)
    assert est.mode == ("checkpointed" if checkpointing else "plain") and est.micro_tokens == n * (prompt + response)
    ratio = (est.activations + est.head) / live.peak
    assert 1.0 <= ratio <= MARGIN, (live.peak, est.activations, est.head, ratio)


def test_compiled_blocks_keep_less_than_eager_ones():
    # Qwen2.5-1.5B's widths: the compiled norms keep their bf16 input, not a float32 upcast and a normalised
    # copy; the compiled MLP recomputes silu's output
    shape = memory_plan.Shape(0, 0, 28, 1536 + 8960, 1536, attention=1536, kv=256, heads=12)
    eager, compiled = memory_plan.layer_bytes(shape, 2, False), memory_plan.layer_bytes(shape, 2, True)
    assert eager - compiled == 2 * 4 * 1536 + 2 * 8960
    assert compiled_blocks.FAMILIES >= {"qwen2", "qwen3"}


def test_log_prob_passes_keep_no_graph_whoever_calls_them():
    # the old-log-prob pass called with grad on (as a benchmark or a user script does): with a graph, every
    # micro-batch's saved activations stayed alive until the last one's were written
    from verl_fast.records.experience import Experience
    from verl_fast.strategies.fsdp_strategy import FSDPStrategy

    model = tiny_model("qwen2", **SHAPES["qwen2"])
    cfg = from_dict({"actor": {"model_name": "m"}, "rollout": {"max_new_tokens": 24, "n": 2},
                     "trainer": {"train_batch_size": 2, "max_prompt_length": 8, "device": "cpu"}})
    strategy = FSDPStrategy(cfg, model, None, None, needs_reference=False)
    ids = torch.randint(1, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    exp = Experience(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_index=torch.tensor([0, 0, 1, 1]),
                     response_mask=torch.ones(4, 24, dtype=torch.long), advantages=torch.zeros(4, 24))
    saved = []
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logp = strategy.actor_logprobs(exp, [torch.arange(2), torch.arange(2, 4)])
    assert logp.shape == (4, 24) and torch.isfinite(logp).all()
    assert not logp.requires_grad and saved == []
