"""An agent program driving the rollout through the OpenAI-compatible endpoint (``rollout.server``)
against the built-in multi-turn rollout, the same turns and tokens (issue 68).

bench_multi_turn's setup (HF decode engine, Qwen2 shapes with random weights, the demo tokenizer, the
calculator described in the system message): ``--prompts`` x ``--n`` trajectories of ``--turns`` model
turns of ``tokens / turns`` tokens, every turn answered with the same short user message:

- built-in: ``MultiTurnRolloutOperator`` with bench_multi_turn's scripted environment;
- endpoint: ``AgentRolloutOperator`` with a plain urllib agent per trajectory (all ``--prompts x --n``
  in flight), each turn one ``/chat/completions`` call that continues the previous one; run with each
  call's KV cache continued (``rollout.server.kv_continuation``, the default) and re-prefilled, and the
  prefill tokens of both (``prefill_tokens_saved``: what the continued calls found cached).

Throughput counts the model's sampled tokens. Target: endpoint >= 0.8x built-in tokens/s at 128
trajectories.

    python benchmarks/bench_agent_endpoint.py [--shape 0.5b] [--device cuda]
    python benchmarks/bench_agent_endpoint.py --device cpu --shape tiny --prompts 2 --n 2 --tokens 16 --reps 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402
from bench_e2e import build_model  # noqa: E402
from bench_multi_turn import operators, timed, tool_prompts  # noqa: E402

TURN_TOKENS = {"value": 0}  # the agent's max_tokens per call, set by main
TURNS = {"value": 0}


def scripted_agent(row, base_url):
    """The scripted environment's turns, as an agent program: ask, answer "Continue.", ask again."""
    messages = list(row["messages"])
    for _ in range(TURNS["value"]):
        body = json.dumps({"model": "policy", "messages": messages, "max_tokens": TURN_TOKENS["value"]}).encode()
        request = urllib.request.Request(f"{base_url}/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            reply = json.loads(response.read())["choices"][0]["message"]
        messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "Continue."}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--window", type=float, default=None, help="rollout.server.batch_window_s (default: the config's)")
    args = p.parse_args(argv)
    if args.turns < 1 or args.tokens < args.turns:
        p.error(f"--turns {args.turns} must be >= 1 and <= --tokens {args.tokens}")
    from dataclasses import replace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.agents.agent_rollout import AgentRolloutOperator
    from verl_fast.agents.server_settings import ServerConfig
    from verl_fast.data import RLDataProcessor

    TURN_TOKENS["value"], TURNS["value"] = args.tokens // args.turns, args.turns
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(args.shape, Path(tmp) / "model", args.device)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
        rows = RLDataProcessor(tokenizer, 1024, args.tokens).encode_all(
            [{"prompt": m} for m in tool_prompts(args.prompts)])
        _, builtin, _ = operators(model, tokenizer, args, args.device)  # built-in: KV continued
        window = {} if args.window is None else {"batch_window_s": args.window}
        settings = ServerConfig(concurrency=args.prompts * args.n, timeout_s=3600.0, **window)
        agents = {kv: AgentRolloutOperator(builtin.engine, replace(builtin.default, logprobs=True), tokenizer,
                                           scripted_agent, replace(settings, kv_continuation=kv))
                  for kv in (True, False)}
        report = Report("agent_endpoint", args.device)
        case = f"{args.shape} {args.prompts}x{args.n}x{args.tokens} t{args.turns}"
        b_time, b_tokens = timed(builtin, rows, args.reps, args.device)
        a_time, a_tokens = timed(agents[True], rows, args.reps, args.device)
        r_time, r_tokens = timed(agents[False], rows, args.reps, args.device)
        a_metrics, r_metrics = agents[True].metrics(), agents[False].metrics()
        builtin.close()
        for agent in agents.values():
            agent.close()
        b_rate, a_rate, r_rate = b_tokens / b_time, a_tokens / a_time, r_tokens / r_time
        saved = a_metrics.get("agent/prefill_tokens_saved", 0.0)
        report.add(case, "built-in multi-turn", b_time * 1e3, note=f"{b_tokens} model tokens, {b_rate:.0f} tokens/s")
        report.add(case, "agent through the endpoint", a_time * 1e3,
                   note=f"{a_tokens} model tokens, {a_rate:.0f} tokens/s, {a_rate / b_rate:.2f}x built-in, "
                        f"{a_metrics['agent/engine_calls']:.0f} generate calls, {saved:.0f} prefill tokens saved")
        report.add(case, "agent through the endpoint, re-prefill", r_time * 1e3,
                   note=f"{r_tokens} model tokens, {r_rate:.0f} tokens/s, {r_rate / b_rate:.2f}x built-in, "
                        f"{r_metrics['agent/prefill_tokens']:.0f} prefill tokens")
        report.meta.update(setup=f"{args.prompts} prompts x {args.n} trajectories in flight, {args.tokens} model tokens "
                                 f"in {args.turns} turns, HF decode engine, temperature 1, window {settings.batch_window_s} s",
                           builtin_tokens_per_s=b_rate, endpoint_tokens_per_s=a_rate, ratio=a_rate / b_rate,
                           target_ratio=0.8, agent_metrics=a_metrics, reprefill_tokens_per_s=r_rate,
                           ratio_reprefill=r_rate / b_rate, prefill_tokens=a_metrics.get("agent/prefill_tokens"),
                           prefill_tokens_reprefill=r_metrics.get("agent/prefill_tokens"),
                           prefill_tokens_saved=saved)
        print(f"{args.shape} endpoint {a_rate:.0f} tokens/s vs built-in {b_rate:.0f} tokens/s: {a_rate / b_rate:.2f}x "
              f"(target >= 0.8x); {saved:.0f} prefill tokens saved (re-prefill: {r_rate / b_rate:.2f}x)", flush=True)
    print(report.table())
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
