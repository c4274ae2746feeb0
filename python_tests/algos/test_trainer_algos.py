"""ReMax, online DPO and DPO's gradient accumulation in the trainer, on tiny random-weight models."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_refs import ref_logprobs
from tiny_models import save_tiny_model
from verl_fast.data import PromptRow
from verl_fast.records.generation import pad_completions
from verl_fast.algos.online_dpo import best_worst_pairs
from verl_fast.trainer.rl_trainer import RLTrainer


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}}
           for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
PAIRS = [{"prompt": f"What is {a} + {a}?", "chosen": f"the answer is {2 * a}", "rejected": "please minus"}
         for a in range(6)]


def config(tmp_path, **sections):
    cfg = {"actor": {"lr": 1e-3, "micro_batch_size": 8},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6, "temperature": 1.0},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu"}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def length_reward(solution_str):
    return float(len(solution_str))


def test_remax_baseline_is_the_greedy_reward(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward,
                        config=config(tmp_path, algorithm={"type": "remax"}))
    rows = trainer.processor.encode_all(PROMPTS[:2])
    metrics = {}
    exp = trainer.make_experience(rows, metrics)
    # the baseline, independently: HF greedy decoding of each prompt, scored by the same reward
    greedy = []
    for row in rows:
        out = model.generate(torch.tensor([row.prompt_ids]), max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        greedy.append(length_reward(tok.decode(out[0, len(row.prompt_ids):], skip_special_tokens=True)))
    base = torch.tensor(greedy, dtype=torch.float64)[exp.prompt_index]
    m = exp.response_mask.double()
    # outcome reward on the last token: the reverse cumulative sum is the score at every response token
    expected = (exp.scores.double() - base)[:, None] * m
    assert torch.allclose(exp.advantages.double(), expected, atol=1e-5)
    assert metrics["reward/greedy_baseline"] == pytest.approx(sum(greedy) / len(greedy), abs=1e-5)
    before = flat(model).clone()
    history = trainer.fit(PROMPTS)
    assert len(history) == 1 and not torch.equal(before, flat(model))


def test_best_worst_pairs():
    batch = [PromptRow(prompt_ids=[1, 2], prompt_text="p0"), PromptRow(prompt_ids=[3], prompt_text="p1")]
    gen = pad_completions([[5, 6, 7], [8], [9, 10], [11], [12]], None, [0, 0, 0, 1, 1], pad_token_id=0,
                          texts=["a", "b", "c", "d", "e"])
    pairs = best_worst_pairs(batch, gen, torch.tensor([0.5, 2.0, -1.0, 3.0, 3.0]))
    assert len(pairs) == 1  # prompt 1's samples tie: no preference, no pair
    p = pairs[0]
    assert (p.prompt_ids, p.chosen_ids, p.rejected_ids, p.chosen, p.rejected) == ([1, 2], [8], [9, 10], "b", "c")


def test_online_dpo_trains_on_its_own_samples(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    cfg = config(tmp_path, algorithm={"type": "online_dpo", "beta": 0.5}, trainer={"total_steps": 2})
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward, config=cfg)
    assert trainer.ref is not None  # DPO's reference: a frozen copy of the actor
    before = flat(model).clone()
    history = trainer.fit(PROMPTS)
    assert [h["dpo/pairs"] for h in history] == [2, 2], history
    assert all("dpo/reward_margin" in h for h in history)
    assert not torch.equal(before, flat(model))
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward,
                  config=config(tmp_path, algorithm={"type": "online_dpo"}, rollout={"n": 1}))


def dpo_config(tmp_path, name, **trainer):
    return {"actor": {"lr": 1e-3}, "reward_fn": {"type": "pairwise_ranking"}, "algorithm": {"type": "dpo"},
            "trainer": {"total_steps": 1, "output_dir": str(tmp_path / name), "progress_bar": False,
                        "plot": False, "device": "cpu", **trainer}}


def test_dpo_gradient_accumulation_is_honoured_and_exact(tiny_path, tmp_path):
    results = []
    for name, per_device, steps in (("ga3", 2, 3), ("ga1", 6, 1)):
        model, tok = load(tiny_path)
        cfg = dpo_config(tmp_path, name, per_device_train_batch_size=per_device, gradient_accumulation_steps=steps)
        trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg)
        assert trainer.cfg.trainer.train_batch_size == 6  # 2 x 3 pairs, not train_batch_size's default 4
        step = trainer.strategy.optimizer_step

        def record():  # the accumulated gradient the optimiser step sees
            actor = trainer.strategy.actor
            results.append(torch.cat([p.grad.flatten() for p in actor.parameters() if p.grad is not None]))
            return step()

        trainer.strategy.optimizer_step = record
        trainer.fit(PAIRS)
    # three micro-batches of 2 pairs accumulate to the same gradient as one micro-batch of 6
    scale = results[1].abs().max()
    assert scale > 0 and (results[0] - results[1]).abs().max() <= 1e-5 * scale


def test_dpo_says_what_does_not_apply(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    cfg = dpo_config(tmp_path, "seed", per_device_train_batch_size=2, gradient_accumulation_steps=1)
    cfg["actor"].update(type="vllm", tensor_parallel_size=2)
    cfg["critic"] = {"type": "hf_transformers", "model_name": "google/flan-t5-base", "use_flash_attention": True}
    with pytest.warns(UserWarning) as caught:
        trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg)
    text = " ".join(str(w.message) for w in caught)
    assert "critic section does not apply" in text and "no VLLMInferenceEngine is started" in text
    assert trainer.engine is None


def test_online_dpo_with_vllm_rollout(tiny_path, tmp_path):
    """vLLM samples the pairs; after the DPO update the engine holds the actor's new weights."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from verl_fast.rollout.vllm_env import configure_vllm_env

    configure_vllm_env()
    model, tok = load(tiny_path)
    cfg = config(tmp_path, algorithm={"type": "online_dpo", "beta": 0.5},
                 rollout={"type": "vllm", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 16})
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward, config=cfg,
                        model_path=str(tiny_path))
    initial, _ = load(tiny_path)
    try:
        history = trainer.fit(PROMPTS)
        assert history[0]["dpo/pairs"] > 0 and "dpo/reward_margin" in history[0]
        rows = trainer.processor.encode_all(PROMPTS[:2])
        out = trainer.engine.generate([r.prompt_ids for r in rows],
                                      trainer.rollout.default.__class__(n=1, temperature=0.0, max_tokens=4))
        model.eval()
        moved = 0.0
        for i, r in enumerate(rows):
            toks = out.response_ids[i][: int(out.response_mask[i].sum())].tolist()
            # the engine's log-probs are the updated actor's, not the initial weights'
            got = out.logprobs[i, : len(toks)].double()
            torch.testing.assert_close(got, ref_logprobs(model, r.prompt_ids, toks), atol=1e-4, rtol=0)
            moved = max(moved, float((got - ref_logprobs(initial, r.prompt_ids, toks)).abs().max()))
        assert moved > 1e-3, "the update did not change the engine's log-probs measurably"
    finally:
        trainer.engine.close()
