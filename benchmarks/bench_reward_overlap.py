"""The reward scored beside the step's old-log-prob pass (``reward_fn.launch_reward_fn_async``)
against scored before it, in the same process.

A GRPO step with two mini-batches (so an old-log-prob pass runs; ``actor.ppo_mini_batch_size``) of a
random-weight Qwen2 shape, and a reward that costs ``--reward-ms`` per batch in one of two ways:
``sleep`` waits outside Python (a sandbox, a remote verifier, a subprocess), ``python`` loops while
holding the GIL (a pure-Python checker: the worst case, since the pass's own Python then shares
the interpreter). Per variant, medians over the steady steps of the step, the old-log-prob pass and
the reward's wait; the table's time is the two together (what the overlap changes; the whole step
varies by more than that on a CPU, from the generation), against the floor ``max(reward, pass)``
with the pass timed in a run whose reward is free.

    python benchmarks/bench_reward_overlap.py                       # CPU, a small shape
    python benchmarks/bench_reward_overlap.py --device cuda --shape 0.5b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402
from bench_e2e import SHAPES, build_model, chat_prompts  # noqa: E402

def costly_reward(kind: str, ms: float, step: List[int]) -> Callable[..., float]:
    """A per-sample reward whose batch costs ``ms``, paid at the first sample of each step
    (``step[0]``, counted by the caller), as a batched checker or one remote call would cost."""
    paid = set()

    def reward(solution_str: str, ground_truth: str) -> float:
        if ms > 0 and step[0] not in paid:
            paid.add(step[0])
            if kind == "sleep":
                time.sleep(ms / 1e3)
            else:
                end = time.perf_counter() + ms / 1e3
                while time.perf_counter() < end:
                    pass
        return float(len(solution_str) % 2)

    return reward


def run(model: Path, args, kind: str, overlap: bool, reward_ms: float) -> Dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.trainer.rl_trainer import RLTrainer

    step = [0]
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(args.device)
    cfg = {"actor": {"lr": 1e-6, "ppo_mini_batch_size": args.prompts * args.n // 2},
           "rollout": {"type": "hf", "n": args.n, "max_new_tokens": args.tokens, "temperature": 1.0,
                       "hf_compile_decode": args.device == "cuda"},
           "reward_fn": {"launch_reward_fn_async": overlap},
           "algorithm": {"type": "grpo"},
           "trainer": {"train_batch_size": args.prompts, "device": args.device, "progress_bar": False, "plot": False,
                       "output_dir": tempfile.mkdtemp(prefix="bench_overlap_")}}
    trainer = RLTrainer(actor_model=actor, tokenizer=AutoTokenizer.from_pretrained(model), config=cfg,
                        reward_fn=costly_reward(kind, reward_ms, step))
    rows = trainer.processor.encode_all([{"prompt": p, "reward_model": {"ground_truth": "0"}, "data_source": "bench"}
                                         for p in chat_prompts(args.prompts * args.steps)])
    steps: List[Dict[str, float]] = []
    for s in range(args.steps):
        step[0] = s
        m = trainer.train_step(rows[s * args.prompts : (s + 1) * args.prompts])
        steps.append({k: float(m.get(f"time/{k}", 0.0)) for k in ("step", "old_logprob", "reward", "update_actor")})
    steady = steps[args.skip:]
    return {k: statistics.median(s[k] for s in steady) for k in steady[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", dest="n", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--reward-ms", type=float, default=300.0)
    p.add_argument("--kinds", default="sleep,python")
    args = p.parse_args()
    folder = build_model(args.shape, Path(tempfile.mkdtemp(prefix="overlap_model_")), args.device)
    report = Report("reward_overlap", args.device, meta={"shape": args.shape, "prompts": args.prompts, "n": args.n,
                                                         "tokens": args.tokens, "reward_ms": args.reward_ms})
    base = run(folder, args, "sleep", True, 0.0)
    print(f"free reward: step {base['step'] * 1e3:.0f} ms, old-log-prob pass {base['old_logprob'] * 1e3:.0f} ms",
          flush=True)
    for kind in args.kinds.split(","):
        case = f"{args.shape} reward {kind} {args.reward_ms:.0f}ms"
        floor = max(args.reward_ms / 1e3, base["old_logprob"])
        report.floors[case] = floor * 1e3
        for overlap in (False, True):
            r = run(folder, args, kind, overlap, args.reward_ms)
            both = r["old_logprob"] + r["reward"]
            report.add(case, "verl_fast beside" if overlap else "scored first", both * 1e3,
                       note=f"old-log-prob {r['old_logprob'] * 1e3:.0f} ms, reward wait {r['reward'] * 1e3:.0f} ms, "
                            f"step {r['step'] * 1e3:.0f} ms")
            print(f"{case} {'beside' if overlap else 'first'}: pass + reward wait {both * 1e3:.0f} ms (old-log-prob "
                  f"{r['old_logprob'] * 1e3:.0f} ms, reward wait {r['reward'] * 1e3:.0f} ms; floor {floor * 1e3:.0f} ms)"
                  f"  step {r['step'] * 1e3:.0f} ms", flush=True)
        report.meta[f"free reward {args.shape}"] = base
        report.save()
    print(report.table())


if __name__ == "__main__":
    main()
