"""Validation (trainer.val_dataset, val_freq, val_before_train, its own sampling) and logged
generations (trainer.log_generations) to generations.jsonl, TensorBoard text and a wandb table (a
recording stand-in for the wandb module)."""

import importlib.machinery
import json
import math
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.trainer.rl_trainer import RLTrainer


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", seed=5)


class FakeWandb(types.ModuleType):
    """What _WandB calls of wandb: init() -> a run whose log / finish are recorded; Table."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.logged = []
        fake = self

        class Run:
            def log(self, data, step=None):
                fake.logged.append((step, data))

            def finish(self):
                fake.finished = True

        class Table:
            def __init__(self, columns, data):
                self.columns, self.data = columns, data

        self.Run, self.Table = Run, Table

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self.Run()


TRAIN = [{"prompt": f"What is {i} + 1?", "data_source": "train"} for i in range(4)]
VAL = [{"prompt": f"Name {w}.", "data_source": src} for w, src in
       [("a cat", "animals"), ("a dog", "animals"), ("one", "numbers"), ("two", "numbers"), ("three", "numbers")]]


def test_validation_metrics_generations_and_loggers(tiny_path, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    calls = []  # every reward call: (prompts, responses, data sources, scores)

    def reward(samples):
        scores = [(len(s.response) % 5) / 4.0 for s in samples]
        calls.append(([s.prompt for s in samples], [s.response for s in samples],
                      [s.data_source for s in samples], scores))
        return scores

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    val_file = tmp_path / "val.jsonl"
    val_file.write_text("".join(json.dumps(r) + "\n" for r in VAL))
    out = tmp_path / "run"
    cfg = {"actor": {"lr": 1e-3},
           "rollout": {"type": "hf", "n": 2, "max_new_tokens": 5, "temperature": 1.0, "hf_fast_decode": "on"},
           "trainer": {"total_steps": 3, "train_batch_size": 2, "output_dir": str(out), "progress_bar": False,
                       "plot": False, "device": "cpu", "hf_export": "none", "val_dataset": str(val_file),
                       "val_freq": 2, "val_before_train": True, "val_max_new_tokens": 7, "log_generations": 3,
                       "loggers": ["jsonl", "tensorboard", "wandb"]}}
    history = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg).fit(TRAIN)

    assert [m["step"] for m in history] == [0, 1, 2, 3]
    val_calls = [c for c in calls if c[2][0] != "train"]
    assert len(val_calls) == 3  # before training, after step 2 (val_freq), after the last step
    for record, (prompts, responses, sources, scores) in zip([history[0], history[2], history[3]], val_calls):
        assert len(prompts) == len(VAL)  # val_n = 1
        want = math.fsum(scores) / len(scores)
        assert record["val/reward/mean"] == pytest.approx(want, abs=1e-12)
        for source in ("animals", "numbers"):
            mine = [s for s, d in zip(scores, sources) if d == source]
            assert record[f"val/{source}/reward/mean"] == pytest.approx(math.fsum(mine) / len(mine), abs=1e-12)
        assert 5 < record["val/response/length"] <= 7  # val_max_new_tokens, not rollout.max_new_tokens
    assert "val/reward/mean" not in history[1]
    # the engine's figures: validation's under val/rollout/, a step's its own rollout's (one call each)
    assert history[1]["rollout/decode_calls"] == 1.0 and history[0]["val/rollout/decode_calls"] == 1.0
    # the first 3 samples of each step and validation, as the reward saw them
    lines = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert [(g["step"], g["kind"]) for g in lines] == (
        [(0, "val")] * 3 + [(1, "train")] * 3 + [(2, "train")] * 3 + [(2, "val")] * 3
        + [(3, "train")] * 3 + [(3, "val")] * 3)
    train_calls = [c for c in calls if c[2][0] == "train"]
    first = lines[3]
    assert (first["prompt"], first["response"], first["reward"]) == (
        train_calls[0][0][0], train_calls[0][1][0], train_calls[0][3][0])
    val0 = lines[0]
    assert (val0["prompt"], val0["response"], val0["reward"], val0["data_source"]) == (
        val_calls[0][0][0], val_calls[0][1][0], val_calls[0][3][0], val_calls[0][2][0])

    # wandb: a table per logged batch of generations, the step metrics with val/ keys
    tables = [(step, key, data[key]) for step, data in fake.logged for key in data if key.startswith("generations/")]
    assert [(step, key) for step, key, _ in tables] == [(0, "generations/val"), (1, "generations/train"),
                                                        (2, "generations/train"), (2, "generations/val"),
                                                        (3, "generations/train"), (3, "generations/val")]
    assert tables[0][2].columns == ["data_source", "prompt", "response", "reward"]
    assert tables[0][2].data[0] == [val0["data_source"], val0["prompt"], val0["response"], val0["reward"]]
    assert any(step == 3 and "val/reward/mean" in data for step, data in fake.logged)

    # TensorBoard: the text of each logged batch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("generations/val/text_summary")}
    assert sorted(texts) == [0, 2, 3]
    assert "| data_source | prompt | response | reward |" in texts[0] and val0["data_source"] in texts[0]
    assert [e.step for e in events.Scalars("val/reward/mean")] == [0, 2, 3]


def test_greedy_validation_is_repeatable_and_val_n_samples(tiny_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    seen = []

    def reward(samples):
        seen.append([s.response for s in samples if s.data_source != "train"])
        return [0.0] * len(samples)  # no advantage, no update: the weights stay as they are

    cfg = {"rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(tmp_path / "r"),
                       "progress_bar": False, "plot": False, "device": "cpu", "hf_export": "none", "val_freq": 1,
                       "val_n": 3}}
    history = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg).fit(TRAIN, val_dataset=VAL)
    val = [s for s in seen if s]
    assert len(val) == 2 and len(val[0]) == 3 * len(VAL)
    assert val[0] == val[1]  # greedy, and the weights did not change
    assert val[0][0] == val[0][1] == val[0][2]  # greedy: a prompt's samples agree
    assert history[1]["val/reward/mean"] == 0.0


def test_validation_settings_without_a_set_or_a_sampler(tiny_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = {"rollout": {"type": "hf", "n": 2},
           "trainer": {"total_steps": 1, "output_dir": str(tmp_path / "x"), "device": "cpu", "val_freq": 2}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=lambda solution_str: 0.0, config=cfg)
    with pytest.raises(ValueError, match="trainer.val_freq / trainer.val_before_train need a validation set"):
        trainer.fit(TRAIN)
    dpo = {"algorithm": {"type": "dpo"}, "reward_fn": {"type": "pairwise_ranking"},
           "trainer": {"total_steps": 1, "output_dir": str(tmp_path / "d"), "device": "cpu", "val_dataset": "v.jsonl"}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=dpo)
    with pytest.raises(ValueError, match="trainer.val_dataset is not supported with algorithm.type=dpo"):
        trainer.fit([{"prompt": "p", "chosen": "a", "rejected": "b"}])


def test_a_resume_drops_the_generations_of_steps_that_run_again(tmp_path):
    from verl_fast.metrics.logger import MetricsLogger

    logger = MetricsLogger(str(tmp_path), 3, progress_bar=False, loggers=["jsonl"])
    logger.resume([])
    sample = {"data_source": "d", "prompt": "p", "response": "r", "reward": 1.0}
    for step in (0, 1, 2, 3):
        logger.log({"step": step})
        logger.log_generations(step, "val" if step == 0 else "train", [sample, sample])
    again = MetricsLogger(str(tmp_path), 3, progress_bar=False, loggers=["jsonl"])
    again.resume([{"step": 0}, {"step": 1}])  # the checkpoint of step 1: steps 2 and 3 run again
    lines = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert [(g["step"], g["kind"]) for g in lines] == [(0, "val"), (0, "val"), (1, "train"), (1, "train")]
