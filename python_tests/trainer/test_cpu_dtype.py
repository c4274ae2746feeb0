"""A 16-bit ``actor.dtype`` on a CPU that only emulates 16-bit products (models/loading.load_dtype): the model
loads in float32 with a one-line notice naming the key, where the CPU has the instructions it loads as asked,
and on a GPU it is never changed."""

import logging

import pytest
import torch

from tiny_models import save_tiny_model
from verl_fast.models import loading
from verl_fast.trainer.rl_trainer import RLTrainer


def test_the_dtype_kept_on_a_gpu_and_where_the_cpu_has_the_instructions(monkeypatch, caplog):
    monkeypatch.setattr(loading, "cpu_has_native", lambda dtype: dtype != "bfloat16")
    with caplog.at_level(logging.WARNING, logger="verl_fast.models.loading"):
        assert loading.load_dtype("bfloat16", False, "actor.dtype") == "bfloat16"
        assert loading.load_dtype("float16", True, "actor.dtype") == "float16"
        assert loading.load_dtype("float32", True, "actor.dtype") == "float32"
        assert not caplog.records
        assert loading.load_dtype("bfloat16", True, "critic.dtype") == "float32"
    assert [r.getMessage().split(" on a CPU")[0] for r in caplog.records] == ["critic.dtype=bfloat16"]


def test_float32_is_always_native():
    assert loading.cpu_has_native("float32")


@pytest.mark.parametrize("native", [False, True])
def test_a_trainer_loading_by_name_on_the_cpu(tmp_path, monkeypatch, native):
    monkeypatch.setattr(loading, "cpu_has_native", lambda dtype: native)
    folder = save_tiny_model(tmp_path / "tiny", family="qwen2")
    trainer = RLTrainer(actor_model=str(folder), reward_fn=lambda solution_str: 0.0,
                        config={"actor": {"dtype": "bfloat16"}, "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
                                "trainer": {"device": "cpu", "output_dir": str(tmp_path / "run"), "plot": False,
                                            "progress_bar": False}})
    dtypes = {p.dtype for p in trainer.strategy.actor.parameters()}
    assert dtypes == {torch.bfloat16 if native else torch.float32}
