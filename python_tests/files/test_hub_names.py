"""Models, tokenizers, reward models and datasets by Hub name, offline: a tiny model and a parquet
dataset placed in a temporary HF cache under their Hub names (``models--org--name/snapshots/<rev>/``
with ``refs/main``), found there by transformers' and datasets' own loading with HF_HUB_OFFLINE=1; a
name found nowhere is one line (and exit code 2 from the CLI).

Each case runs in a fresh interpreter: huggingface_hub reads HF_HOME / HF_HUB_OFFLINE when it is
imported."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiny_models import save_tiny_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _place(cache: Path, kind: str, name: str) -> Path:
    """The snapshot folder of ``name`` in the hub cache, with refs/main naming it."""
    repo = cache / f"{kind}--{name.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return repo / "snapshots" / REVISION


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    import pandas as pd

    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub"
    save_tiny_model(_place(cache, "models", "org/tiny"), family="qwen2")
    data = _place(cache, "datasets", "org/sums") / "data"
    data.mkdir(parents=True)
    rows = [{"data_source": "sums", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
             "reward_model": {"ground_truth": str(a + b)}} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    pd.DataFrame(rows).to_parquet(data / "train-00000-of-00001.parquet")
    return home


def _env(hf_home):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    return {"VLLM_CPU_KVCACHE_SPACE": "1", **env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
            "PYTHONWARNINGS": "ignore"}


def _run(hf_home, args, cwd):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=_env(hf_home))


@pytest.mark.parametrize("rollout", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_train_by_hub_names_offline(hf_home, tmp_path, rollout):
    """The vLLM engine loads the model from the cache's snapshot that transformers loaded it from."""
    if rollout == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed")
    config = tmp_path / "c.yaml"
    config.write_text(textwrap.dedent(f"""
        actor: {{model_name: org/tiny, lr: 1.0e-3}}
        rollout: {{type: {rollout}, n: 2, max_new_tokens: 4, max_model_len: 128, max_num_seqs: 8}}
        reward_fn: {{type: gsm8k}}
        trainer: {{dataset: org/sums, total_steps: 1, train_batch_size: 2, device: cpu, plot: false,
                   progress_bar: false, output_dir: {tmp_path / 'run'}}}
    """))
    run = _run(hf_home, ["-m", "verl_fast", "train", "--config", str(config)], tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    card = (step / "README.md").read_text()
    assert "base_model: org/tiny" in card and "datasets:\n- org/sums" in card
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["config"]["actor"]["model_name"] == "org/tiny" and len(state["history"]) == 1
    assert ("rollout/kv_cache_usage_peak" in state["history"][0]) == (rollout == "vllm")  # the engine asked for


def test_names_in_the_cache_load_and_missing_ones_are_one_line(hf_home, tmp_path):
    code = textwrap.dedent("""
        import sys
        from verl_fast.files import hub
        from verl_fast.data import RLDataProcessor
        from verl_fast.models.loading import load_causal_lm, resolve
        from verl_fast.rewards import RewardInput, RewardModel

        model, tok = load_causal_lm("org/tiny")
        folder = resolve("org/tiny")  # what a vLLM engine loads: the cache's snapshot
        assert folder.endswith("models--org--tiny/snapshots/REV"), folder
        assert type(model).__name__ == "Qwen2ForCausalLM" and tok.chat_template
        rm = RewardModel.from_pretrained("org/tiny")
        assert len(rm([RewardInput(prompt="1 + 1?", response="2")])) == 1
        rows = RLDataProcessor(None).load("org/sums")
        assert [r["reward_model"]["ground_truth"] for r in rows] == ["3", "7", "11", "15"], rows
        for what, load in [("actor.model_name=org/none", lambda: load_causal_lm("org/none")),
                           ("reward_fn.model_name=org/none", lambda: RewardModel.from_pretrained("org/none")),
                           ("trainer.dataset=org/none", lambda: RLDataProcessor(None).load("org/none"))]:
            try:
                load()
            except hub.NameNotFound as e:
                message = str(e)
                assert message.startswith(what + ": no such local folder, and not in the HF cache "
                                          "(HF_HUB_OFFLINE is set)"), message
                assert "\\n" not in message, message
            else:
                sys.exit(f"{what}: loaded")
        print("ok")
    """).replace("REV", REVISION)
    run = _run(hf_home, ["-c", code], tmp_path)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]


def test_cli_names_a_missing_model_in_one_line(hf_home, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1?", "reward_model": {"ground_truth": "2"}}\n')
    run = _run(hf_home, ["-m", "verl_fast", "train", "actor.model_name=org/none", "reward_fn.type=gsm8k", f"trainer.dataset={rows}",
                         "rollout.type=hf", "trainer.plot=false", f"trainer.output_dir={tmp_path / 'run'}"], tmp_path)
    assert run.returncode == 2, run.stderr[-4000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verl-fast train: config error: actor.model_name=org/none: "
                                                   "no such local folder"), run.stderr[-4000:]
    missing = _run(hf_home, ["-m", "verl_fast", "train", "trainer.dataset=org/none", "rollout.type=hf",
                             "trainer.plot=false", f"trainer.output_dir={tmp_path / 'run2'}"], tmp_path)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        missing.stderr.strip()] and "trainer.dataset=org/none: no such local folder" in missing.stderr
