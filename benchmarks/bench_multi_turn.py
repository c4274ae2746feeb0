"""Multi-turn rollout throughput against single-turn at the same token count (issue 46).

The run's rollout as the trainer calls it, on the HF decode engine (bf16 autocast, the fast decode,
its forward compiled on a GPU), Qwen2 shapes of bench_e2e with random weights and the demo tokenizer:
``--prompts`` x ``--n`` samples of ``--tokens`` model tokens each,

- single-turn: one ``generate`` call, ``--tokens`` per sample (the baseline, and the floor: a
  multi-turn rollout samples the same tokens and more context);
- multi-turn (ours): the same tokens in ``--turns`` turns of ``tokens / turns``, a scripted environment
  answering every turn with a short user message (random weights never call a tool, so the turns are
  driven by the environment and each ends at its fixed length).

Throughput counts the model's sampled tokens only. Target: multi-turn >= 0.8x single-turn tokens/s.

    python benchmarks/bench_multi_turn.py [--shape 0.5b] [--device cuda] [--turns 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, sync  # noqa: E402
from bench_e2e import build_model, chat_prompts  # noqa: E402

from verl_fast.agents.environments import Environment, StepResult, row_messages  # noqa: E402


class FixedTurns(Environment):
    """Answers every model turn with the same short user message (the turn limit ends the episode)."""

    def reset(self, row):
        return row_messages(row)

    def step(self, message):
        return StepResult([{"role": "user", "content": "Continue."}])


def operators(model, tokenizer, args, device: str):
    from verl_fast.agents.settings import MultiTurnConfig
    from verl_fast.agents.rollout import MultiTurnRolloutOperator
    from verl_fast.rollout.base import SamplingSpec
    from verl_fast.rollout.hf_engine import HFGenerateEngine
    from verl_fast.rollout.operator import RolloutOperator

    engine = HFGenerateEngine(model, tokenizer, max_batch_size=args.prompts * args.n,
                              autocast_dtype=torch.bfloat16 if device == "cuda" else None,
                              compile_decode=device == "cuda")
    per_turn = args.tokens // args.turns
    single = SamplingSpec(n=args.n, max_tokens=args.tokens, logprobs=False)
    # the trajectory's budget holds the model's tokens and the observations between them
    multi = SamplingSpec(n=args.n, max_tokens=args.tokens + args.turns * 64, logprobs=False)
    mt = MultiTurnConfig(environment=f"{Path(__file__).resolve()}:FixedTurns", max_turns=args.turns,
                         max_tokens_per_turn=per_turn)
    return (RolloutOperator(engine, single), MultiTurnRolloutOperator(engine, multi, tokenizer, mt, {}))


def timed(op, rows, reps: int, device: str):
    times, out = [], None
    for i in range(reps + 1):  # the first call warms up (compiles on a GPU)
        sync(device)
        start = time.perf_counter()
        out = op.rollout(rows, seed=i)
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), int(out.response_mask.sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.data import RLDataProcessor

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(args.shape, Path(tmp) / "model", args.device)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
    rows = RLDataProcessor(tokenizer, 512, args.tokens).encode_all([{"prompt": m} for m in chat_prompts(args.prompts)])
    single, multi = operators(model, tokenizer, args, args.device)
    report = Report("multi_turn", args.device)
    case = f"{args.shape} {args.prompts}x{args.n}x{args.tokens} t{args.turns}"
    s_time, s_tokens = timed(single, rows, args.reps, args.device)
    m_time, m_tokens = timed(multi, rows, args.reps, args.device)
    m_metrics = multi.metrics()
    multi.close()
    s_rate, m_rate = s_tokens / s_time, m_tokens / m_time
    report.floors[case] = s_time * 1e3 * m_tokens / s_tokens  # single-turn's rate at multi-turn's token count
    report.add(case, "single-turn", s_time * 1e3, note=f"{s_tokens} tokens, {s_rate:.0f} tokens/s")
    report.add(case, "verl_fast multi-turn", m_time * 1e3,
               note=f"{m_tokens} model tokens, {m_rate:.0f} tokens/s, {m_rate / s_rate:.2f}x single-turn, "
                    f"{m_metrics['multi_turn/generate_calls']:.0f} generate calls")
    report.meta.update(setup=f"{args.prompts} prompts x {args.n}, {args.tokens} model tokens, {args.turns} turns, "
                             "HF decode engine", single_tokens_per_s=s_rate, multi_tokens_per_s=m_rate,
                       ratio=m_rate / s_rate, target_ratio=0.8, multi_turn_metrics=m_metrics)
    print(f"{args.shape} multi-turn {m_rate:.0f} tokens/s vs single-turn {s_rate:.0f} tokens/s: "
          f"{m_rate / s_rate:.2f}x (target >= 0.8x)", flush=True)
    print(report.table())
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
