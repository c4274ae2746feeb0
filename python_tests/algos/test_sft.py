"""SFT: the three dataset formats' loss masks, and the trainer's loss against a float64 reference of
the trained tokens' mean NLL and against TRL's SFTTrainer; gradient accumulation exact; validation loss;
checkpoint and resume.
The preference algorithms (kto, orpo, simpo, cpo) run a step through the trainer."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.data import sft_data
from verl_fast.trainer.rl_trainer import RLTrainer

CHATS = [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                       {"role": "assistant", "content": f"{2 * i}" + " indeed" * (i % 3)},
                       {"role": "user", "content": "sure?"}, {"role": "assistant", "content": "yes"}]}
         for i in range(6)]
PLAIN = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(3)] + [{"text": "one two three"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m") / "m", family="qwen2")


def test_masks_cover_the_assistant_and_completion_tokens(model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    chat = sft_data.encode(tok, CHATS[:1], 4096)[0]
    trained = tok.decode([t for t, m in zip(chat.ids, chat.loss_mask) if m])
    assert "0" in trained and "yes" in trained and "what is" not in trained and "sure?" not in trained
    completion, text = sft_data.encode(tok, PLAIN[1:2] + PLAIN[3:], 4096)
    assert tok.decode([t for t, m in zip(completion.ids, completion.loss_mask) if m]).startswith(" 2")
    assert completion.ids[-1] == tok.eos_token_id and completion.loss_mask[-1] == 1
    assert all(text.loss_mask)
    with pytest.raises(ValueError, match="SFT row 0: an SFT row needs messages"):
        sft_data.encode(tok, [{"question": "x"}], 64)
    with pytest.raises(ValueError, match="SFT row 0: no assistant / completion token within"):
        sft_data.encode(tok, PLAIN[:1], 2)


def reference_nll(model, examples):
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            lp = logp[torch.arange(len(e.ids) - 1), ids[0, 1:]]
            w = torch.tensor(e.loss_mask[1:], dtype=torch.float64)
            total, count = total - float((lp * w).sum()), count + float(w.sum())
    return total / count


def run(model_path, out, data, patch=None, **over):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_path)
    trainer_cfg = {"total_steps": 1, "output_dir": str(out), "progress_bar": False, "plot": False, "device": "cpu",
                   "train_batch_size": len(data), **over.pop("trainer", {})}
    cfg = {"actor": {"lr": 0.0, **over.pop("actor", {})}, "algorithm": {"type": "sft", **over.pop("algorithm", {})},
           "trainer": trainer_cfg, **over}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg)
    grads, step = [], trainer.strategy.optimizer_step

    def record():
        grads.append(torch.cat([p.grad.flatten() for p in trainer.strategy.actor.parameters() if p.grad is not None]))
        return step()

    trainer.strategy.optimizer_step = record
    if patch is not None:
        patch(trainer)
    return trainer, trainer.fit(data), grads, model


def test_sft_loss_is_the_trained_tokens_mean_nll_and_exact_under_accumulation(model_path, tmp_path):
    data = CHATS + PLAIN
    one, h1, g1, model = run(model_path, tmp_path / "one", data, actor={"micro_batch_size": 16})
    ga, h3, g3, _ = run(model_path, tmp_path / "ga", data,
                        trainer={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 5},
                        actor={"micro_batch_size": 2})
    want = reference_nll(model, one.algorithm.encode(one.processor, data))
    assert h1[-1]["sft/loss"] == pytest.approx(want, rel=1e-5)
    assert h3[-1]["sft/loss"] == pytest.approx(want, rel=1e-5)
    scale = g1[0].abs().max()
    assert (g1[0] - g3[0]).abs().max() <= 1e-5 * scale
    assert (tmp_path / "one" / "checkpoints").exists()


def test_an_sft_step_out_of_memory_is_replanned_and_trains_as_a_clean_one(model_path, tmp_path, caplog):
    """Passes that run out of device memory after a first micro-batch (injected on the CPU): the step is
    re-planned once (gradient checkpointing on), its partial gradients dropped, and trains as a step that
    never failed; the step's metrics say so."""
    data = CHATS + PLAIN

    def fail_once(trainer):
        passes, calls = trainer.strategy.forward_backward, []

        def forward_backward(exp, micro, loss_fn, entropy=True):
            calls.append(len(micro))
            if len(calls) == 1:
                passes(exp, micro[:1], loss_fn, entropy)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return passes(exp, micro, loss_fn, entropy)

        trainer.strategy.forward_backward = forward_backward

    _, clean, g_clean, _ = run(model_path, tmp_path / "clean", data, actor={"micro_batch_size": 4})
    with caplog.at_level(logging.WARNING, logger="verl_fast.trainer.updates"):
        trainer, failed, g_failed, _ = run(model_path, tmp_path / "failed", data, patch=fail_once,
                                           actor={"micro_batch_size": 4})
    assert any("retrying the step with gradient checkpointing on" in r.getMessage() for r in caplog.records)
    assert trainer.strategy.checkpointing and failed[-1]["perf/update_replanned"] == 1.0
    assert clean[-1]["perf/update_replanned"] == 0.0
    assert failed[-1]["sft/loss"] == pytest.approx(clean[-1]["sft/loss"], rel=1e-6)
    assert (g_failed[0] - g_clean[0]).abs().max() <= 1e-5 * g_clean[0].abs().max()


def test_sft_validation_through_fit(model_path, tmp_path):
    data = CHATS + PLAIN
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_path)
    cfg = {"actor": {"lr": 0.0}, "algorithm": {"type": "sft"},
           "trainer": {"total_steps": 2, "train_batch_size": 5, "output_dir": str(tmp_path / "v"), "plot": False,
                       "progress_bar": False, "device": "cpu", "val_before_train": True, "save_freq": 1}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg)
    history = trainer.fit(data, val_dataset=CHATS[:3])
    want = reference_nll(model, trainer.algorithm.encode(trainer.processor, CHATS[:3]))
    assert history[0]["val/loss"] == pytest.approx(want, rel=1e-5)
    assert history[-1]["val/loss"] == pytest.approx(want, rel=1e-5)  # lr 0: unchanged
    again = RLTrainer(actor_model=AutoModelForCausalLM.from_pretrained(model_path), tokenizer=tok,
                      config={**cfg, "trainer": {**cfg["trainer"], "total_steps": 3, "val_before_train": False}})
    assert again.fit(data, val_dataset=CHATS[:3])[-1]["step"] == 3  # resumed from step 2


PAIRS = [{"prompt": f"Q{i}: what is {i} + {i}?", "chosen": f"{2 * i} is the sum", "rejected": f"{i} plus"}
         for i in range(4)]
UNPAIRED = [{"prompt": f"Q{i}", "completion": f"answer {i}", "label": i % 2 == 0} for i in range(4)]


@pytest.mark.parametrize("kind", ["kto", "orpo", "simpo", "cpo"])
def test_preference_algorithms_take_a_step(model_path, tmp_path, kind):
    data = UNPAIRED if kind == "kto" else PAIRS
    trainer, history, grads, _ = run(model_path, tmp_path / kind, data, actor={"lr": 1e-3},
                                     reward_fn={"type": "pairwise_ranking"}, algorithm={"type": kind, "beta": 0.5})
    assert (trainer.ref is not None) == (kind == "kto")
    assert torch.isfinite(torch.tensor(history[-1][f"{kind}/loss"])) and grads[0].abs().max() > 0


def test_fsdp2_on_two_processes_matches_one(model_path, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from ports import free_port
    from sft_dist_worker import config, sft_rows

    worker = Path(__file__).resolve().parents[1] / "support" / "sft_dist_worker.py"
    port, dist_dir = free_port(), tmp_path / "fsdp2"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port), str(model_path), str(dist_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    one = RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(model_path),
                    config=config(str(tmp_path / "one"), "none")).fit(sft_rows(), val_dataset=sft_rows()[:3])
    two = json.loads((dist_dir / "rank0.json").read_text())
    assert [h["sft/loss"] for h in two] == pytest.approx([h["sft/loss"] for h in one], rel=1e-5)
    assert one[1]["sft/loss"] < one[0]["sft/loss"]  # the first step moved the weights
    assert two[-1]["val/loss"] == pytest.approx(one[-1]["val/loss"], rel=1e-5)  # 3 rows over 2 ranks
    # the gradients agree (their norms, before each step); the weights after Adam's steps are not compared:
    # its update of a gradient near 0 is near +-lr whatever the summation order left there
    assert [h["actor/grad_norm"] for h in two] == pytest.approx([h["actor/grad_norm"] for h in one], rel=1e-5)
    assert AutoModelForCausalLM.from_pretrained(dist_dir / "checkpoints" / "step_000002") is not None


def test_lora_sft_trains_the_adapters_only(model_path, tmp_path):
    trainer, history, grads, _ = run(model_path, tmp_path / "lora", CHATS, actor={"lr": 1e-2, "lora": {"r": 4}},
                                     trainer={"total_steps": 2, "train_batch_size": 3})
    names = [n for n, p in trainer.strategy.actor.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert history[1]["sft/loss"] < history[0]["sft/loss"]


def test_every_spec_declares_what_the_assembly_asks():
    """samples, needs_critic and item_type are asked of the algorithm's spec, never of its name."""
    from verl_fast import config as C
    from verl_fast.algos import registry
    from verl_fast.data import PreferencePair, PromptRow

    for name, spec in registry.SPECS.items():
        built = registry.build(C.from_dict({"algorithm": {"type": name}, "rollout": {"n": 2}}))
        assert (spec.samples, spec.needs_critic, spec.item_type) == (built.samples, built.needs_critic,
                                                                     built.item_type), name
    offline = sorted(n for n, s in registry.SPECS.items() if not s.samples)
    assert offline == ["cpo", "dpo", "kto", "orpo", "sft", "simpo"]
    assert [n for n, s in registry.SPECS.items() if s.needs_critic] == ["ppo"]
    assert registry.SPECS["online_dpo"].item_type is PromptRow and registry.SPECS["orpo"].item_type is PreferencePair


def test_bad_sft_combinations_are_refused():
    from verl_fast import config as C

    with pytest.raises(ValueError, match="actor.use_kl_loss / algorithm.use_kl_in_reward is not supported with "
                                         "algorithm.type=sft"):
        C.from_dict({"algorithm": {"type": "sft"}, "actor": {"use_kl_loss": True}})
    with pytest.raises(ValueError, match="is not supported with algorithm.type=simpo, which loads no reference"):
        C.from_dict({"algorithm": {"type": "simpo"}, "reward_fn": {"type": "pairwise_ranking"},
                     "actor": {"use_kl_loss": True}})


def test_dpo_ipo_takes_per_token_log_ratios(model_path, tmp_path):
    beta = 0.5
    trainer, history, _, model = run(model_path, tmp_path / "ipo", PAIRS, reward_fn={"type": "pairwise_ranking",
                                                                                       "reference_free": True},
                                     algorithm={"type": "dpo", "loss_type": "ipo", "beta": beta})
    with torch.no_grad():
        def mean_logp(prompt_ids, response_ids):
            ids = torch.tensor([prompt_ids + response_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            return float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][-len(response_ids):].mean())

        want = sum((mean_logp(p.prompt_ids, p.chosen_ids) - mean_logp(p.prompt_ids, p.rejected_ids)
                    - 1 / (2 * beta)) ** 2 for p in trainer.algorithm.encode(trainer.processor, PAIRS)) / len(PAIRS)
    assert history[-1]["dpo/loss"] == pytest.approx(want, rel=1e-5)


def test_kto_at_the_reference_is_half_the_weights(model_path, tmp_path):
    # lr 0 and the reference a copy of the actor: every log-ratio and the KL estimate are 0, so each
    # example's loss is its weight times 1 - sig(0)
    _, history, grads, _ = run(model_path, tmp_path / "kto0", UNPAIRED,
                               algorithm={"type": "kto", "kto_desirable_weight": 1.3, "kto_undesirable_weight": 0.7})
    weights = [1.3 if row["label"] else 0.7 for row in UNPAIRED]
    assert history[-1]["kto/loss"] == pytest.approx(0.5 * sum(weights) / len(weights), rel=1e-6)
    assert history[-1]["kto/kl"] == 0.0 and grads[0].abs().max() > 0
    with pytest.raises(ValueError, match="row 0's label must be true or false"):
        run(model_path, tmp_path / "bad", [{"prompt": "a", "completion": "b", "label": 1}],
            algorithm={"type": "kto"})


def response_logp(model, prompt_ids, response_ids):
    """(sum, count) of the response tokens' float64 log-probs under ``model``."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + response_ids])
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        return float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][-len(response_ids):].sum()), len(response_ids)


@pytest.mark.parametrize("kind", ["orpo", "simpo", "cpo"])
def test_reference_free_losses_through_the_trainer(model_path, tmp_path, kind):
    import math

    beta, gamma, alpha = 0.5, 0.3, 0.25
    trainer, history, _, model = run(model_path, tmp_path / kind, PAIRS, reward_fn={"type": "pairwise_ranking"},
                                     algorithm={"type": kind, "beta": beta, "simpo_gamma": gamma, "cpo_alpha": alpha},
                                     trainer={"per_device_train_batch_size": 3})
    logsig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
    losses, nll, tokens = [], 0.0, 0
    for p in trainer.algorithm.encode(trainer.processor, PAIRS):
        (sc, nc), (sr, nr) = response_logp(model, p.prompt_ids, p.chosen_ids), response_logp(model, p.prompt_ids,
                                                                                                p.rejected_ids)
        nll, tokens = nll - sc, tokens + nc
        if kind == "orpo":  # log odds of p = exp(mean log-prob)
            odds = [a - math.log(1 - math.exp(a)) for a in (sc / nc, sr / nr)]
            losses.append(-beta * logsig(odds[0] - odds[1]))
        elif kind == "simpo":
            losses.append(-logsig(beta * (sc / nc - sr / nr) - gamma))
        else:
            losses.append(-logsig(beta * (sc - sr)))
    m = history[-1]
    assert m[f"{kind}/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)  # 2 micro-batches of 3 and 1
    assert m[f"{kind}/nll"] == pytest.approx(nll / tokens, rel=1e-5)


def test_sft_loss_and_gradient_equal_trl_sfttrainers(model_path, tmp_path):
    """The same tokenised rows (ours, handed to TRL pre-tokenised with their completion masks) through TRL's
    SFTTrainer.compute_loss and through our trainer at lr 0: the same loss and gradient in float32."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import SFTConfig, SFTTrainer

    data = CHATS + PLAIN
    ours, history, grads, _ = run(model_path, tmp_path / "ours", data, actor={"micro_batch_size": 16})
    rows = ours.algorithm.encode(ours.processor, data)
    tok = AutoTokenizer.from_pretrained(model_path)
    dataset = datasets.Dataset.from_list([{"input_ids": list(r.ids), "completion_mask": list(r.loss_mask)}
                                          for r in rows])
    theirs = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    args = SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows), max_steps=1,
                     learning_rate=0.0, report_to=[], use_cpu=True, bf16=False, packing=False,
                     completion_only_loss=True, dataloader_drop_last=False)
    trl_trainer = SFTTrainer(model=theirs, args=args, train_dataset=dataset, processing_class=tok)
    batch = next(iter(trl_trainer.get_train_dataloader()))
    targets = batch["labels"][:, 1:] != -100  # the model shifts: a row's first label predicts nothing
    assert int(targets.sum()) == sum(sum(r.loss_mask[1:]) for r in rows)  # the same trained tokens
    theirs.train()
    loss = trl_trainer.compute_loss(theirs, batch)
    loss.backward()
    assert history[-1]["sft/loss"] == pytest.approx(float(loss), rel=1e-5)
    their_grad = torch.cat([p.grad.flatten() for p in theirs.parameters() if p.grad is not None])
    assert their_grad.shape == grads[0].shape
    assert (their_grad - grads[0]).abs().max() <= 1e-5 * grads[0].abs().max()
