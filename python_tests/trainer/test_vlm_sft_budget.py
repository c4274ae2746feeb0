"""The token budget of an SFT step on rows with images (trainer/updates.py ``micro``, trainer/batching.py
``token_budget`` / ``padded_budget``, strategies/memory_plan.py ``layer_bytes``) against what the passes
really hold, on the CPU: a small random Qwen2.5-VL whose language model has the 3B's proportions (MLP
much wider than the stream, grouped keys), with ``actor.compile_blocks`` set true.

- A vision-language model's language norms and MLPs compile as a text model's do (the key's auto: on a GPU
  for an unsharded actor without adapters), and the plan counts them eager either way; rows with images (padded, attended through sdpa with their padding
  mask) keep their keys and values repeated to the query heads and the mask; one eager decoder layer's
  saved tensors are that count, a compiled one's at most that.
- The auto budget (free memory faked as a GPU's) cuts the step's rows into micro-batches whose passes'
  peak, counted as an allocator sees it (``LiveBytes``, the frozen vision tower's forward included),
  stays within each micro-batch's share of the memory the budget was given; the split step's loss is
  the unsplit one's."""

import pytest
import torch

pytest.importorskip("PIL")

from live_bytes import LiveBytes, layer_saves  # noqa: E402
from tiny_vlm import square_image  # noqa: E402
from verl_fast.models import random_vlm  # noqa: E402
from verl_fast.models.wrapping import hf_module  # noqa: E402
from verl_fast.strategies import memory_plan  # noqa: E402
from verl_fast.strategies.fsdp_strategy import micro_logprobs, passes  # noqa: E402
from verl_fast.trainer import batching  # noqa: E402
from verl_fast.trainer.batching import loss_normalisers  # noqa: E402
from verl_fast.trainer.rl_trainer import RLTrainer  # noqa: E402

# the 3B's proportions at a small size: MLP 5.4 x the stream, four query heads to a key head (several key heads:
# transformers repeats them into copies, one head alone into a view)
SHAPE = dict(hidden_size=64, intermediate_size=344, num_layers=4, num_heads=8, num_kv_heads=2, vision_depth=2,
             vision_dim=32, vision_heads=2, vision_intermediate=64)
WORDS = "red square blue line the picture shows a large small corner left right top bottom and of".split()
SIDE = 112  # pixels: 16 image tokens, 64 patches through the tower
FREE = 100 * 2**20  # the faked GPU's free bytes
SLACK = 1.03  # a pass's peak over its share of the budget's memory, at most


@pytest.fixture
def sft_step(monkeypatch, tmp_path):
    """(trainer, experience) of 6 SFT rows, one picture and a 128-word answer each (the benchmark's rows,
    smaller pictures), the actor's gradients and optimiser states allocated (the budget then counts
    activations only)."""
    monkeypatch.setitem(random_vlm.SHAPES, "budget", SHAPE)
    monkeypatch.setitem(random_vlm.INITIALIZER_RANGE, "budget", 0.1)
    model, processor = random_vlm.build("qwen2_5_vl", "budget")
    words = torch.randint(len(WORDS), (6, 128), generator=torch.Generator().manual_seed(0)).tolist()
    rows = [{"images": [square_image(1 + i % 3, SIDE, i)],
             "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
                          {"role": "assistant", "content": [{"type": "text", "text": " ".join(WORDS[w] for w in ws)}]}]}
            for i, ws in enumerate(words)]
    cfg = {"algorithm": {"type": "sft", "sft_max_length": 1024},
           "actor": {"lr": 1e-6, "use_dynamic_bsz": True, "compile_blocks": True, "fused_logprobs": "on"},
           "trainer": {"total_steps": 1, "progress_bar": False, "plot": False, "device": "cpu",
                       "output_dir": str(tmp_path / "run"), "train_batch_size": 6,
                       "image_min_pixels": SIDE * SIDE, "image_max_pixels": SIDE * SIDE}}
    trainer = RLTrainer(actor_model=model, tokenizer=processor, config=cfg)
    examples = trainer.algorithm.encode(trainer.processor, rows)
    exp = trainer.algorithm.experience(examples, processor.tokenizer.pad_token_id, trainer.device)
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.zeros_like(p)
    trainer.strategy.optimizer.step()  # its states exist now
    for p in trained:
        p.grad = torch.zeros_like(p)
    return trainer, exp


def fake_gpu(monkeypatch, updates):
    """The auto budget's memory queries answered as a GPU with ``FREE`` bytes free would answer them."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (FREE, 2 * FREE))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(batching, "MIN_TOKEN_BUDGET", 64)  # a budget of a few rows of this small model
    monkeypatch.setattr(updates, "device", torch.device("cuda"))


def test_a_vision_language_layer_saves_what_the_plan_counts_for_padded_rows(sft_step):
    trainer, exp = sft_step
    model, cfg = trainer.strategy.actor, trainer.cfg
    family = memory_plan.family_of(hf_module(model))
    cuda, auto = torch.device("cuda"), type(cfg)()
    # the key set true, or its auto on a GPU, compiles the language blocks; the budget counts them eager
    assert memory_plan.blocks_compiled(cfg, cuda, False, False, family)
    assert not memory_plan.blocks_compiled(cfg, cuda, False, False, family, counted=True)
    assert memory_plan.blocks_compiled(auto, cuda, False, False, family)
    assert not memory_plan.blocks_compiled(auto, torch.device("cpu"), False, False, family)
    assert not memory_plan.blocks_compiled(auto, cuda, False, True, family)
    assert memory_plan.blocks_compiled(auto, cuda, False, False, "qwen2", counted=True)
    assert trainer.strategy.compiled and not trainer.strategy.compiled_counted
    model = model.to(torch.bfloat16)  # the GPU passes' dtype
    layer = model.model.language_model.layers[1]
    sub = exp.select(torch.arange(3))  # the tower casts the float32 pixels to its weights' dtype
    held = {}
    for compiled in (False, True):
        with passes(model, compiled, False), layer_saves(model, layer) as saved:
            micro_logprobs(model, sub, cfg, None)
        held[compiled] = float(sum(saved.values()))
    rows, width = sub.input_ids.shape
    shape = memory_plan.shape_of(model)
    want = memory_plan.layer_bytes(shape, 2, False, padded_width=width) * rows * width
    got = held[False]
    # what the count leaves out: the norms' float32 rsqrt a token (4 bytes each)
    assert abs(got - want) <= 0.03 * want, (got, want)
    assert held[True] < got, held  # compiled, the layer keeps less than the eager count
    # counted as packed rows through compiled blocks, about a third of the layer would go uncounted
    assert memory_plan.layer_bytes(shape, 2, True) * rows * width < 0.8 * got


def test_sft_micro_batches_with_images_fit_the_memory_their_budget_was_given(monkeypatch, sft_step):
    trainer, exp = sft_step
    updates, strategy = trainer.updates, trainer.strategy
    fake_gpu(monkeypatch, updates)
    rows = torch.arange(exp.num_sequences)
    micro = updates.micro(exp, rows)
    budget = updates.last_budget
    # rows with images run padded: their budget is the packed rows' over what a padded token keeps
    assert budget < updates.auto_budget
    room = batching.MEMORY_FRACTION * FREE  # no gradient or optimiser state still to come
    assert len(micro) > 1, [len(idx) for idx in micro]
    counts = loss_normalisers(exp.advantages)

    def loss(logp, entropy, sub):
        return trainer.algorithm.loss(logp, sub, counts)

    split = 0.0
    for idx in micro:
        sub = exp.select(idx)
        tokens = sub.input_ids.numel()  # as the pass runs them: rows x the micro-batch's width
        assert tokens <= budget
        with LiveBytes() as live:
            stats, _ = strategy.forward_backward(exp, [idx], loss, entropy=False)
        split += float(stats[0]["loss_sum"])
        # the pass's peak within the micro-batch's share of the room, bar what the count leaves out (the
        # rows' pixel values and boolean padding mask, alive through the pass: a few percent at this width,
        # far less at a real one); and within the room
        assert live.peak <= SLACK * tokens * room / budget, (len(idx), tokens, live.peak, tokens * room / budget)
        assert live.peak <= room
    stats, _ = strategy.forward_backward(exp, [rows], loss, entropy=False)
    assert split == pytest.approx(float(stats[0]["loss_sum"]), rel=1e-5)


def test_compiled_language_blocks_give_the_eager_logprobs_and_gradients(sft_step):
    """``actor.compile_blocks: true`` on a vision-language actor: the language model's norms and MLPs (every
    layer's two norms and MLP, the final norm; none of the vision tower's) run compiled, with the eager
    passes' log-probs and gradients."""
    from verl_fast.models import compiled_blocks

    trainer, exp = sft_step
    model, cfg = trainer.strategy.actor, trainer.cfg
    swapped = compiled_blocks.blocks(hf_module(model))
    names = {n for n, m in hf_module(model).named_modules() if any(m is s for s in swapped)}
    assert len(swapped) == 3 * SHAPE["num_layers"] + 1 and not any("visual" in n for n in names), names
    sub = exp.select(torch.arange(3))
    weights = torch.randn(sub.response_mask.shape, generator=torch.Generator().manual_seed(1))
    runs = []
    for compiled in (False, True):
        model.zero_grad(set_to_none=True)
        with passes(model, compiled, False):
            lp, _ = micro_logprobs(model, sub, cfg, None)
            (lp * weights * sub.response_mask).sum().backward()
        runs.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    valid = sub.response_mask.bool()
    torch.testing.assert_close(runs[1][0][valid], runs[0][0][valid], atol=2e-5, rtol=2e-5)
    assert runs[0][1].keys() == runs[1][1].keys() and runs[0][1]
    for name, grad in runs[1][1].items():
        torch.testing.assert_close(grad, runs[0][1][name], atol=5e-5, rtol=1e-4, msg=name)
