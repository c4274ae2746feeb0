"""The rollout engines by name (``verl_fast/rollout/engines.py``): ``rollout.type``'s choices come from the
table, each class answers for its kind (checks, process set-up, construction, memory), and an engine
registered from outside the package (here, in the test) trains a step with no other change."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config as C
from verl_fast import extras
from verl_fast.rollout import engines
from verl_fast.records.generation import GenerationOutput, pad_completions
from verl_fast.rollout.base import RolloutEngine
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.rollout.vllm_engine import VLLMInferenceEngine
from verl_fast.strategies import memory_plan
from verl_fast.trainer.rl_trainer import RLTrainer


class ToyEngine(RolloutEngine):
    """Answers sample ``j`` of a prompt with the prompt's tokens reversed from the ``j``-th on, at most
    ``max_tokens`` of them, without log-probs (it samples from no policy, so the sync guardrail has
    nothing to compare): a deterministic engine whose samples differ within a group."""

    owns_weights = True  # a copy of its own: the trainer pushes the weights after each update
    built = []  # (the engine, what build received) of every engine built
    checked = []  # the configs check_config saw

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id
        self.synced = 0
        self.asleep = False

    @classmethod
    def check_config(cls, cfg) -> None:
        cls.checked.append(cfg)
        if cfg.rollout.temperature == 0.5:
            raise ValueError("rollout.temperature=0.5 is not supported with rollout.type=toy")

    @classmethod
    def build(cls, cfg, actor, tokenizer, *, model_path=None, autocast_dtype=None, source=None):
        engine = cls(tokenizer)
        cls.built.append((engine, actor, model_path))
        return engine

    def generate(self, prompts, sampling) -> GenerationOutput:
        specs = [sampling] * len(prompts) if not isinstance(sampling, (list, tuple)) else list(sampling)
        completions, index = [], []
        for i, (prompt, spec) in enumerate(zip(prompts, specs)):
            for j in range(spec.n):
                completions.append(list(prompt[::-1][j:j + spec.max_tokens]))
                index.append(i)
        return pad_completions(completions, None, index, self.pad_token_id,
                               texts=self.tokenizer.batch_decode(completions),
                               finish_reasons=["length"] * len(completions))

    def sync_from(self, model):
        self.synced += 1
        return {"bytes": 0}

    def sleep(self) -> None:
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False


@pytest.fixture
def toy(monkeypatch):
    # the registration lasts this test only: the table and rollout.type's choices are restored after it
    monkeypatch.setattr(engines, "_ENGINES", dict(engines._ENGINES))
    monkeypatch.setattr(C.ENGINES, "_names", list(C.ENGINES._names))
    engines.register("toy", ToyEngine)
    ToyEngine.built.clear()
    ToyEngine.checked.clear()
    return ToyEngine


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", seed=5)


def test_the_choices_come_from_the_table():
    assert set(engines.names()) >= {"hf", "vllm"}
    assert list(C.ENGINES)[:3] == ["auto", "hf", "vllm"]
    assert engines.engine_class("hf") is HFGenerateEngine and engines.engine_class("vllm") is VLLMInferenceEngine
    assert engines.engine_class("vllm").name == "vllm"
    with pytest.raises(ValueError, match=r"rollout.type must be one of \['auto', 'hf', 'vllm'.*got 'sglang'"):
        C.from_dict({"rollout": {"type": "sglang"}})
    with pytest.raises(ValueError, match="rollout.type must be one of"):
        engines.engine_class("sglang")
    with pytest.raises(ValueError, match="other than 'auto'"):
        engines.register("auto", ToyEngine)


def test_each_engine_answers_for_its_kind():
    with pytest.raises(ValueError, match="rollout.quantization=awq is not supported with rollout.type=hf"):
        C.from_dict({"rollout": {"type": "hf", "quantization": "awq"}})
    with pytest.raises(ValueError, match="rollout.kv_cache_dtype=fp8 is not supported with rollout.type=hf"):
        C.from_dict({"rollout": {"type": "hf", "kv_cache_dtype": "fp8"}})
    with pytest.raises(ValueError, match="trainer.async_mode=full is not supported with rollout.type=vllm"):
        C.from_dict({"rollout": {"type": "vllm", "enable_sleep_mode": False},
                     "algorithm": {"rollout_correction": True}, "trainer": {"async_mode": "full"}})
    C.from_dict({"rollout": {"type": "auto", "quantization": "awq"}})  # auto: the engine is chosen beside the actor
    vllm = C.from_dict({"rollout": {"type": "vllm"}})
    assert engines.owns_weights(vllm) and not engines.owns_weights(C.from_dict({"rollout": {"type": "hf"}}))
    assert not engines.owns_weights(C.from_dict({}))  # auto may decode with the actor itself
    assert ("vllm", "vllm", "rollout.type=vllm") in [need for p in extras.PROVIDERS for need in p(vllm)]


def test_a_toy_engine_from_outside_the_package_runs_a_step(toy, tiny_path, tmp_path):
    with pytest.raises(ValueError, match="rollout.temperature=0.5 is not supported with rollout.type=toy"):
        C.from_dict({"rollout": {"type": "toy", "temperature": 0.5}})
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    rows = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}} for a, b in [(1, 2), (3, 4)]]
    cfg = {"actor": {"lr": 1e-2}, "rollout": {"type": "toy", "n": 2, "max_new_tokens": 3},
           "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu", "hf_export": "none", "save_freq": 0}}
    before = [p.detach().clone() for p in model.parameters()]
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg,
                        reward_fn=lambda solution_str: float(sum(map(ord, solution_str)) % 7))
    engine = trainer.engine
    assert isinstance(engine, ToyEngine) and ToyEngine.built[0][0] is engine and ToyEngine.checked
    history = trainer.fit(rows)
    assert len(history) == 1 and engine.synced >= 1  # the weights pushed to the engine's own copy
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.actor.parameters()))  # the update trained
    # the memory plan counts the engine's own copy as the engine's (one_step keeps no trainer-side copy)
    one_step = C.from_dict({**cfg, "algorithm": {"rollout_correction": True},
                            "trainer": {**cfg["trainer"], "async_mode": "one_step"}})
    shape = memory_plan.Shape(parameters=10, trained=10, layers=1, width=1, hidden=1, adapted=0)
    assert memory_plan.async_copies(one_step, shape, 2) == 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        msg = engines.unused(C.from_dict({"rollout": {"type": "toy"}}), "sft")
    assert msg and "rollout.type=toy does not apply to algorithm.type=sft" in msg and not caught
