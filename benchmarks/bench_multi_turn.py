"""Multi-turn rollout throughput against single-turn at the same token count (issue 46).

The run's rollout as the trainer calls it, on the HF decode engine (bf16 autocast, the fast decode,
its forward compiled on a GPU), Qwen2 shapes of bench_e2e with random weights and the demo tokenizer:
``--prompts`` x ``--n`` samples of ``--tokens`` model tokens each,

- single-turn: one ``generate`` call, ``--tokens`` per sample (the baseline, and the floor: a
  multi-turn rollout samples the same tokens and more context);
- multi-turn (ours): the same tokens in ``--turns`` turns of ``tokens / turns``, a scripted environment
  answering every turn with a short user message (random weights never call a tool, so the turns are
  driven by the environment and each ends at its fixed length), each trajectory's KV cache continued
  across turns (``rollout.multi_turn.kv_continuation``, the default: a turn prefills only the new tokens);
- multi-turn, a decoder per turn: the same with each turn's decode in a decoder of its own (on a GPU its
  step's CUDA graph captured again every turn: ``kv_turns.RESTART`` off), in the same run;
- multi-turn, re-prefill: the same with ``kv_continuation: false`` (every turn prefills the whole
  conversation again), in the same run. Meta has both variants' prefill tokens and the tokens saved.

Each multi-turn variant's generate calls (the last repetition's) are printed and kept in meta (``calls``): the
call's rows and seconds, the host seconds before it (since the previous call ended; the first: since the
rollout began) and the engine's figures (``prefill_s``, ``decode_s``, ``graph_captures``: ``HFGenerateEngine.
metrics``), with the KV-continued variants' ``launch_s`` (the call's entry to its prefill's launch) and
``return_s`` (its tokens on the host to its return: ``TurnCache.call_metrics``), and each variant's host
seconds (the rollout's seconds outside its generate calls).

The system message describes the calculator of examples/tool_calling/ as ours does for a chat template
without tools (``tools_system_prompt``), so our prompts carry the tool as TRL's do (its template renders
the schema).

- TRL (``--impls ours,trl``): TRL's tool-calling GRPO rollout (``GRPOTrainer(tools=[calculator])``, the
  calculator of examples/tool_calling/) on the same model folder, prompts, ``n``, temperature and lengths,
  in a process of its own after ours: vLLM colocate where vLLM imports on a GPU (``--trl-rollout auto``),
  else HF generate; its turns scripted as ours are (benchmarks/multi_turn_trl.py says how), multi-turn
  and single-turn. Its rows' times are scaled to our multi-turn's model-token count.

Throughput counts the model's sampled tokens only (TRL: its ``tool_mask`` 1 tokens). Target (issue 68):
multi-turn >= 0.85x single-turn tokens/s.

    python benchmarks/bench_multi_turn.py [--shape 0.5b] [--device cuda] [--turns 4] [--impls ours,trl]
    python benchmarks/bench_multi_turn.py --device cpu --shape tiny --prompts 2 --n 2 --tokens 32 --reps 1 \
        --impls ours,trl    # the CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, sync  # noqa: E402
from bench_e2e import build_model, chat_prompts  # noqa: E402

from multi_turn_trl import CALCULATOR  # noqa: E402

from verl_fast.agents.environments import Environment, StepResult, row_messages  # noqa: E402
from verl_fast.rollout import kv_turns  # noqa: E402


class FixedTurns(Environment):
    """Answers every model turn with the same short user message (the turn limit ends the episode)."""

    def reset(self, row):
        return row_messages(row)

    def step(self, message):
        return StepResult([{"role": "user", "content": "Continue."}])


def tool_prompts(count: int):
    """bench_e2e's chat prompts, the calculator described in their system message."""
    from verl_fast.agents.parsing import tools_system_prompt
    from verl_fast.agents.tools import load_tool, tool_schema

    described = tools_system_prompt([tool_schema(load_tool(CALCULATOR))])
    return [[{**m, "content": f"{m['content']}\n{described}"} if m["role"] == "system" else m for m in prompt]
            for prompt in chat_prompts(count)]


def operators(model, tokenizer, args, device: str):
    from verl_fast.agents.settings import MultiTurnConfig
    from verl_fast.agents.rollout import MultiTurnRolloutOperator
    from verl_fast.records.generation import SamplingSpec
    from verl_fast.rollout.hf_engine import HFGenerateEngine
    from verl_fast.rollout.operator import RolloutOperator

    engine = HFGenerateEngine(model, tokenizer, max_batch_size=args.prompts * args.n,
                              autocast_dtype=torch.bfloat16 if device == "cuda" else None,
                              compile_decode=device == "cuda", fast_decode="on")
    per_turn = args.tokens // args.turns
    single = SamplingSpec(n=args.n, max_tokens=args.tokens, logprobs=False)
    # the trajectory's budget holds the model's tokens and the observations between them
    multi = SamplingSpec(n=args.n, max_tokens=args.tokens + args.turns * 64, logprobs=False)
    mt = MultiTurnConfig(environment=f"{Path(__file__).resolve()}:FixedTurns", max_turns=args.turns,
                         max_tokens_per_turn=per_turn)
    again = replace(mt, kv_continuation=False)
    return (RolloutOperator(engine, single), MultiTurnRolloutOperator(engine, multi, tokenizer, mt, {}),
            MultiTurnRolloutOperator(engine, multi, tokenizer, again, {}))


def timed(op, rows, reps: int, device: str, restart: bool = True):
    """The median seconds of ``reps`` rollouts after a warm-up, and the model tokens of the last; ``restart``
    off: each turn's decode in a decoder of its own (``kv_turns.RESTART``)."""
    times, out = [], None
    kv_turns.RESTART = restart
    try:
        for i in range(reps + 1):  # the first call warms up (compiles on a GPU)
            sync(device)
            start = time.perf_counter()
            out = op.rollout(rows, seed=i)
            sync(device)
            if i:
                times.append(time.perf_counter() - start)
    finally:
        kv_turns.RESTART = True
    return statistics.median(times), int(out.response_mask.sum())


def calls_of(name: str, op) -> dict:
    """A multi-turn variant's last rollout: its generate calls (printed) and its host seconds."""
    metrics = op.metrics()
    host = metrics["multi_turn/seconds"] - metrics["multi_turn/generate_seconds"]
    print(f"{name}: {metrics['multi_turn/seconds']:.3f} s, {metrics['multi_turn/generate_seconds']:.3f} s in "
          f"{len(op.calls)} generate calls, {host:.3f} s host", flush=True)
    for k, c in enumerate(op.calls, 1):
        phases = (f"launch {c['launch_s'] * 1e3:.1f} ms, " if "launch_s" in c else "")
        engine = (f" ({phases}prefill {c['prefill_s'] * 1e3:.1f} ms, decode {c['decode_s'] * 1e3:.1f} ms"
                  + (f", return {c['return_s'] * 1e3:.1f} ms" if "return_s" in c else "")
                  + f", {c['graph_captures']:.0f} graph captures)" if "decode_s" in c else "")
        print(f"  call {k}: {c['rows']:.0f} rows, {c['host_s'] * 1e3:.1f} ms host before it, generate "
              f"{c['generate_s'] * 1e3:.1f} ms{engine}", flush=True)
    return {"calls": list(op.calls), "host_s": host, "seconds": metrics["multi_turn/seconds"]}


def trl_rollout(args) -> str:
    """``--trl-rollout``, with ``auto`` read: vLLM colocate where it imports on a GPU, else HF generate."""
    if args.trl_rollout != "auto":
        return args.trl_rollout
    if args.device != "cuda":
        return "hf"
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return "vllm" if probe.returncode == 0 else "hf"


def run_trl(args, folder: Path, rollout: str) -> dict:
    """TRL's row in a process of its own (benchmarks/multi_turn_trl.py); a failure or a timeout is recorded."""
    out = folder.parent / "trl.json"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "multi_turn_trl.py"), "--model", str(folder),
           "--out", str(out), "--device", args.device, "--rollout", rollout]
    cmd += [f"--{key}={getattr(args, key)}" for key in ("prompts", "n", "tokens", "turns", "reps")]
    try:
        code = subprocess.run(cmd, timeout=args.trl_timeout, env=dict(os.environ)).returncode
    except subprocess.TimeoutExpired:
        return {"rollout": rollout, "failure": f"ran past --trl-timeout {args.trl_timeout:.0f} s"}
    if code != 0 or not out.is_file():
        return {"rollout": rollout, "failure": f"multi_turn_trl.py exited {code} (its log is above)"}
    return json.loads(out.read_text())


def add_trl(report: Report, case: str, trl: dict, m_tokens: int, m_rate: float) -> None:
    """TRL's rows, their times scaled to our multi-turn's model tokens, and the ratios in meta."""
    if "failure" in trl:
        report.meta["trl"] = trl
        print(f"TRL: {trl['failure']}", flush=True)
        return
    name = f"TRL {trl['rollout']}"  # its version: meta's trl.impl
    rates = {}
    for kind, label in (("multi", "multi-turn tools"), ("single", "single-turn")):
        run = trl[kind]
        rates[kind] = run["model_tokens"] / run["s"]
        report.add(case, f"{name} {label}", m_tokens / rates[kind] * 1e3,
                   note=f"{run['model_tokens']} model tokens ({run['all_tokens']} with tool results) in "
                        f"{run['s']:.3f} s, {rates[kind]:.0f} tokens/s")
    report.meta.update(trl=trl, trl_multi_tokens_per_s=rates["multi"], trl_single_tokens_per_s=rates["single"],
                       trl_ratio=rates["multi"] / rates["single"], ours_over_trl_multi=m_rate / rates["multi"])
    print(f"TRL {trl['rollout']} multi-turn {rates['multi']:.0f} tokens/s ({rates['multi'] / rates['single']:.2f}x "
          f"its single-turn); ours {m_rate / rates['multi']:.2f}x TRL's", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--impls", default="ours", help="ours, or ours,trl: TRL's tool-calling rollout beside ours")
    p.add_argument("--trl-rollout", choices=["auto", "vllm", "hf"], default="auto")
    p.add_argument("--trl-timeout", type=float, default=300.0, help="seconds for TRL's process")
    args = p.parse_args(argv)
    impls = args.impls.split(",")
    if not set(impls) <= {"ours", "trl"} or "ours" not in impls:
        p.error(f"--impls: ours or ours,trl, got {args.impls!r}")
    if args.turns < 1 or args.tokens < args.turns:
        p.error(f"--turns {args.turns} must be >= 1 and <= --tokens {args.tokens}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.data import RLDataProcessor

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(args.shape, Path(tmp) / "model", args.device)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
        rows = RLDataProcessor(tokenizer, 1024, args.tokens).encode_all(
            [{"prompt": m} for m in tool_prompts(args.prompts)])
        single, multi, refill = operators(model, tokenizer, args, args.device)
        report = Report("multi_turn", args.device)
        case = f"{args.shape} {args.prompts}x{args.n}x{args.tokens} t{args.turns}"
        s_time, s_tokens = timed(single, rows, args.reps, args.device)
        s_engine = single.engine.metrics()
        print(f"single-turn: {s_time:.3f} s, engine {s_engine}", flush=True)
        m_time, m_tokens = timed(multi, rows, args.reps, args.device)
        m_metrics, m_calls = multi.metrics(), calls_of("multi-turn, KV continued", multi)
        d_time, d_tokens = timed(multi, rows, args.reps, args.device, restart=False)
        d_calls = calls_of("multi-turn, KV continued, a decoder per turn", multi)
        r_time, r_tokens = timed(refill, rows, args.reps, args.device)
        r_metrics, r_calls = refill.metrics(), calls_of("multi-turn, re-prefill", refill)
        multi.close()
        refill.close()
        s_rate, m_rate, r_rate, d_rate = s_tokens / s_time, m_tokens / m_time, r_tokens / r_time, d_tokens / d_time
        report.floors[case] = s_time * 1e3 * m_tokens / s_tokens  # single-turn's rate at multi-turn's token count
        report.add(case, "single-turn", s_time * 1e3, note=f"{s_tokens} tokens, {s_rate:.0f} tokens/s")
        report.add(case, "verl_fast multi-turn", m_time * 1e3,
                   note=f"{m_tokens} model tokens, {m_rate:.0f} tokens/s, {m_rate / s_rate:.2f}x single-turn, "
                        f"{m_metrics['multi_turn/generate_calls']:.0f} generate calls, KV continued: "
                        f"{m_metrics['multi_turn/prefill_tokens']:.0f} prefill tokens")
        report.add(case, "verl_fast multi-turn, a decoder per turn", d_time * 1e3,
                   note=f"{d_tokens} model tokens, {d_rate:.0f} tokens/s, {d_rate / s_rate:.2f}x single-turn, KV "
                        f"continued, {sum(c.get('graph_captures', 0) for c in d_calls['calls']):.0f} graph captures")
        report.add(case, "verl_fast multi-turn, re-prefill", r_time * 1e3,
                   note=f"{r_tokens} model tokens, {r_rate:.0f} tokens/s, {r_rate / s_rate:.2f}x single-turn, "
                        f"{r_metrics['multi_turn/prefill_tokens']:.0f} prefill tokens")
        report.meta.update(setup=f"{args.prompts} prompts x {args.n}, {args.tokens} model tokens, {args.turns} turns, "
                                 "HF decode engine, temperature 1", single_tokens_per_s=s_rate,
                           multi_tokens_per_s=m_rate, ratio=m_rate / s_rate, target_ratio=0.85,
                           reprefill_tokens_per_s=r_rate, reprefill_ratio=r_rate / s_rate,
                           prefill_tokens=m_metrics["multi_turn/prefill_tokens"],
                           prefill_tokens_reprefill=r_metrics["multi_turn/prefill_tokens"],
                           prefill_tokens_saved=m_metrics["multi_turn/prefill_tokens_saved"],
                           multi_turn_metrics=m_metrics, reprefill_metrics=r_metrics, impls=impls,
                           single_engine=s_engine, multi_turn_calls=m_calls, decoder_per_turn_calls=d_calls,
                           decoder_per_turn_tokens_per_s=d_rate, reprefill_calls=r_calls,
                           prompt_tokens_mean=statistics.mean(len(r.prompt_ids) for r in rows))
        print(f"{args.shape} multi-turn {m_rate:.0f} tokens/s vs single-turn {s_rate:.0f} tokens/s: "
              f"{m_rate / s_rate:.2f}x (target >= 0.85x); a decoder per turn {d_rate / s_rate:.2f}x; re-prefilling every "
              f"turn {r_rate / s_rate:.2f}x; prefill "
              f"tokens {report.meta['prefill_tokens']:.0f} (re-prefill {report.meta['prefill_tokens_reprefill']:.0f}, "
              f"saved {report.meta['prefill_tokens_saved']:.0f})", flush=True)
        if "trl" in impls:
            report.save(summary=False)  # ours' figures kept should TRL's process not come back
            del single, multi, refill, model
            if args.device == "cuda":
                torch.cuda.empty_cache()
            add_trl(report, case, run_trl(args, folder, trl_rollout(args)), m_tokens, m_rate)
    print(report.table())
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
