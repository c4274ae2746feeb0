"""Every folder of examples/ runs one training step on tiny random-weight models (CPU), so none rots.

Configs run through the CLI with their model names, dataset size, batch and rollout length scaled
down by ``--set`` overrides (the algorithm, losses and every other key as written); the FSDP2
example runs under torchrun with 2 processes (gloo); the LoRA example's script runs as it is; the
validation example logs a step-0 validation beside its step.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import build_tokenizer, save_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# megatron/ runs in test_megatron_trainer.py (it needs torchrun and megatron-core's CPU stand-ins)
FOLDERS = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir() and p.name != "megatron")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {"qwen2": save_tiny_model(root / "qwen2", family="qwen2"),
           "llama": save_tiny_model(root / "llama", family="llama", seed=1)}
    import transformers

    tok = build_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = transformers.Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=256,
                                      eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    torch.manual_seed(0)
    moe = transformers.AutoModelForCausalLM.from_config(cfg)
    moe.generation_config.eos_token_id = moe.generation_config.pad_token_id = eos
    moe.save_pretrained(root / "qwen3_moe")
    tok.save_pretrained(root / "qwen3_moe")
    out["qwen3_moe"] = root / "qwen3_moe"
    return out


def overrides(folder, models, out_dir):
    sets = [f"actor.model_name={models['qwen3_moe' if folder == 'moe' else 'qwen2']}",
            f"trainer.output_dir={out_dir}", "trainer.total_steps=1", "trainer.progress_bar=false",
            "trainer.plot=false", "trainer.device=cpu", "actor.micro_batch_size=8", "trainer.max_prompt_length=256"]
    if folder == "sft":  # its own chats, beside the config; a validation loss after its step
        sets += ["trainer.train_batch_size=4", f"trainer.dataset={EXAMPLES / 'sft' / 'data.jsonl'}",
                 f"trainer.val_dataset={EXAMPLES / 'sft' / 'val.jsonl'}"]
    elif folder != "dpo":
        sets += ["trainer.train_batch_size=2", "rollout.type=hf", "rollout.n=2", "rollout.max_new_tokens=4"]
        if folder not in ("code_reward", "openenv_env", "verifiers_env"):  # their datasets are their own
            sets.append("trainer.dataset_kwargs={size: 8, seed: 1}")
    if folder == "ppo":
        sets.append(f"critic.model_name={models['llama']}")  # another family than the actor
    return [arg for s in sets for arg in ("--set", s)]


def webgpt_rows(path):
    rows = [{"question": {"full_text": f"What is {a} + {a}?"}, "answer_1": f"It is {2 * a}.", "answer_2": "No idea.",
             "score_1": 1.0 + a, "score_2": 0.0} for a in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def load_script(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_has_a_readme_line():
    readme = (EXAMPLES / "README.md").read_text()
    for folder in sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()):
        assert f"`{folder}/`" in readme, f"examples/README.md has no line for {folder}/"


@pytest.mark.parametrize("folder", FOLDERS)
def test_example_runs_one_step(folder, models, tmp_path, monkeypatch):
    out_dir = tmp_path / "run"
    monkeypatch.chdir(EXAMPLES.parent)  # tool_calling (agent_endpoint) names its tool (agent) by a path from the root
    if folder == "lora":
        history = load_script(EXAMPLES / "lora" / "train.py").main(
            ["--model", str(models["qwen2"]), "--steps", "1", "--rollout", "hf", "--output_dir", str(out_dir),
             "--dataset_size", "8", "--samples", "2", "--max_new_tokens", "4"])
        assert len(history) == 1 and "reward/mean" in history[0]
        return
    if folder == "vlm_grpo":  # its own tiny random-weight Qwen2-VL and synthetic pictures
        history = load_script(EXAMPLES / "vlm_grpo" / "train.py").main(
            ["--steps", "1", "--output_dir", str(out_dir), "--dataset_size", "8", "--samples", "2"])
        assert len(history) == 1 and 0.0 <= history[0]["reward/mean"] <= 1.0
        return
    args = ["--config", str(EXAMPLES / folder / "config.yaml")] + overrides(folder, models, out_dir)
    if folder == "dpo":  # the hub builder's data from a local webgpt file, then the offline builder's
        data = tmp_path / "data" / "rl_dataset.pt"
        load_script(EXAMPLES / "dpo" / "build_dataset.py").main(
            ["--tokenizer", str(models["qwen2"]), "--source", str(webgpt_rows(tmp_path / "webgpt.jsonl")),
             "--out", str(data)])
        assert len(torch.load(data, weights_only=False)) == 6
        load_script(EXAMPLES / "dpo" / "build_local_dataset.py").main(
            ["--tokenizer", str(models["qwen2"]), "--size", "16", "--out", str(data)])
        args += ["--dataset_path", str(data)]
    if folder == "fsdp2":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               "-m", "verl_fast", "train"] + args
        # run outside the repository: from its root, `-m verl_fast` would import the unbuilt source folder
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    else:
        import argparse

        from verl_fast.cli import train as train_cli

        parser = argparse.ArgumentParser()
        train_cli.add_arguments(parser)
        assert train_cli.run(parser.parse_args(args)) == 0
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    if folder == "grpo_validation":  # validated before training (step 0) and after its one step
        assert [r["step"] for r in records] == [0, 1]
        assert all(0.0 <= r["val/reward/mean"] <= 1.2 for r in records)
        assert {"reward/accuracy/mean", "reward/short_answer/mean", "actor/lr"} <= set(records[1])
        assert records[1]["reward/mean"] == pytest.approx(
            records[1]["reward/accuracy/mean"] + 0.2 * records[1]["reward/short_answer/mean"], rel=1e-5)
        assert (out_dir / "generations.jsonl").is_file()
        return
    assert len(records) == 1 and records[0]["step"] == 1
    if folder == "sft":
        assert records[0]["sft/loss"] > 0 and records[0]["val/loss"] > 0 and (out_dir / "checkpoints").is_dir()
    if folder == "agent_endpoint":  # the agent's calls went through the endpoint, none failed
        assert records[0]["agent/calls"] >= 4 and records[0]["agent/failed"] == 0
    if folder == "code_reward":  # the programs ran in the sandbox (random weights: none passes its tests)
        assert "reward/code/seconds" in records[0] and records[0]["reward/mean"] == 0.0
    if folder == "judge_reward":  # random weights write no score: every verdict fails to parse
        assert records[0]["reward/judge/parse_failures"] == 1.0 and "reward/judge/seconds" in records[0]
    if folder == "openenv_env":  # the OpenEnv environment answered every turn (random weights: no right guess)
        assert records[0]["multi_turn/turns_mean"] >= 1 and records[0]["multi_turn/openenv_reward"] == 0.0
    if folder == "verifiers_env":  # each trajectory ran the verifiers rollout; 4 tokens end it before its rubric
        assert records[0]["multi_turn/turns_mean"] >= 1 and records[0]["multi_turn/verifiers_errors"] == 0.0
        assert records[0]["multi_turn/verifiers_unscored"] == 4.0  # 2 prompts x 2 samples
    if folder in ("tool_calling", "mcp_tools"):  # a multi-turn rollout ran, with its tool figures
        assert records[0]["multi_turn/turns_mean"] >= 1 and "multi_turn/tool_calls" in records[0]


def test_vlm_example_reward_rises(tmp_path):
    """The vision-language example as written (30 steps, a tiny random-weight Qwen2-VL): its reward rises."""
    history = load_script(EXAMPLES / "vlm_grpo" / "train.py").main(["--output_dir", str(tmp_path / "run")])
    rewards = [h["reward/mean"] for h in history]
    assert len(rewards) == 30 and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards
