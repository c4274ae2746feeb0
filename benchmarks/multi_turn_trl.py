"""TRL's tool-calling GRPO rollout, timed on the rows and lengths of bench_multi_turn.py (its ``trl`` row).

Run by bench_multi_turn.py in a process of its own (TRL's vLLM colocate engine starts there); writes one
JSON. TRL 1.16's ``GRPOTrainer(tools=[...])`` renders the tools' schemas into the prompt with the chat
template, parses each completion with ``trl.chat_template_utils.parse_response`` (the tokenizer's response
template), runs the calls, appends the results as ``tool`` messages rendered by the template, and generates
again for the trajectories that called a tool (``_tool_call_loop``), until no call,
``max_tool_calling_iterations`` or ``max_completion_length`` (model and tool tokens together); the tool
tokens get 0 in its ``tool_mask``, which masks them out of the loss.

What is set here:

- the chat template: TRL's Qwen2.5 template (``trl.chat_template_utils.qwen2_5_chat_template``, one TRL
  recognises for parsing tool calls) on the demo tokenizer, whose own template renders no tools;
- the tool: the calculator of examples/tool_calling/tools.py;
- the turns: random weights never write a tool call, so every completion is parsed by TRL's parser and
  then, when it holds no call, read as a call of the calculator (``scripted_parser``) -- the stand-in for
  the scripted environment of our row; ``max_tool_calling_iterations = turns - 1`` ends the trajectory;
- each turn's length: ``generation_kwargs`` (``max_tokens`` for vLLM, ``max_new_tokens`` for HF generate)
  caps a turn at ``tokens / turns``, and ``max_completion_length`` is the trajectory's budget
  (``tokens + turns * 64``, as ours);
- single-turn: the same trainer with the scripted calls off and a turn of ``tokens``.

The time is that of TRL's ``_generate`` (generation, parsing, the tool loop) inside
``_generate_and_score_completions``, the call its training step makes; the first call warms up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import sync  # noqa: E402
from bench_e2e import chat_prompts  # noqa: E402

from verl_fast.agents.tools import load_tool  # noqa: E402

CALCULATOR = f"{Path(__file__).resolve().parents[1] / 'examples' / 'tool_calling' / 'tools.py'}:calculator"

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 + 34"}}}


def scripted_parser(parse, state):
    """TRL's ``parse_response``, then a calculator call added where the completion holds none and
    ``state["calls"]`` is on."""

    def parse_response(tokenizer, ids, prefix=None, tools=None):
        message = parse(tokenizer, ids, prefix=prefix, tools=tools)
        if state["calls"] and not message.get("tool_calls"):
            message = {**message, "tool_calls": [CALL]}
        return message

    return parse_response


def build_trainer(args, rollout: str):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = qwen2_5_chat_template
    per_turn = args.tokens // args.turns
    key = "max_tokens" if rollout == "vllm" else "max_new_tokens"
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3) if rollout == "vllm" else {}
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_multi_turn_trl_"), per_device_train_batch_size=args.prompts,
        gradient_accumulation_steps=args.n, num_generations=args.n,
        max_completion_length=args.tokens + args.turns * 64, generation_kwargs={key: per_turn},
        max_tool_calling_iterations=args.turns - 1, bf16=args.device == "cuda", beta=0.0, temperature=1.0,
        model_init_kwargs={"dtype": torch.float32}, report_to="none", disable_tqdm=True, seed=0,
        use_cpu=args.device == "cpu", **vllm)
    rows = Dataset.from_list([{"prompt": p} for p in chat_prompts(args.prompts)])
    trainer = GRPOTrainer(model=args.model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                          args=config, processing_class=tokenizer, train_dataset=rows, tools=[load_tool(CALCULATOR)])
    return trainer, key


def set_turn_tokens(trainer, key: str, tokens: int) -> None:
    """Each turn's cap, where TRL 1.16 keeps it: vLLM's sampling arguments or HF's generation config."""
    if key == "max_tokens":
        trainer.vllm_generation.generation_kwargs[key] = tokens
    else:
        trainer.generation_config.max_new_tokens = tokens
        trainer.generation_kwargs[key] = tokens


def timed_rollouts(trainer, args, reps: int):
    """Median seconds of TRL's ``_generate`` over ``reps`` calls after a warm-up, and the last call's
    token counts (model tokens: ``tool_mask`` 1; all: the completion ids)."""
    generate, times, counts = trainer._generate, [], {}

    def timed(prompts):
        sync(args.device)
        start = time.perf_counter()
        out = generate(prompts)
        sync(args.device)
        times.append(time.perf_counter() - start)
        completion_ids, tool_mask = out[1], out[2]
        counts.update(all_tokens=sum(len(c) for c in completion_ids),
                      model_tokens=sum(sum(m) for m in tool_mask) if tool_mask is not None
                      else sum(len(c) for c in completion_ids))
        return out

    trainer._generate = timed
    inputs = [{"prompt": p} for p in chat_prompts(args.prompts) for _ in range(args.n)]
    try:
        for _ in range(reps + 1):
            trainer._generate_and_score_completions(inputs)
    finally:
        trainer._generate = generate
    return statistics.median(times[1:]), counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rollout", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    import trl
    import trl.trainer.grpo_trainer as grpo

    state = {"calls": True}
    grpo.parse_response = scripted_parser(grpo.parse_response, state)
    start = time.perf_counter()
    trainer, key = build_trainer(args, args.rollout)
    startup = time.perf_counter() - start
    set_turn_tokens(trainer, key, args.tokens // args.turns)
    m_time, m_counts = timed_rollouts(trainer, args, args.reps)
    metrics = {k: v[-1] for k, v in trainer._metrics["eval" if not trainer.model.training else "train"].items()
               if k.startswith(("tools/", "completions/mean_length"))}
    state["calls"] = False
    set_turn_tokens(trainer, key, args.tokens)
    s_time, s_counts = timed_rollouts(trainer, args, args.reps)
    prompt_ids = trainer._tokenize_prompts(chat_prompts(args.prompts))[0]
    import transformers

    versions = {"trl": trl.__version__, "transformers": transformers.__version__}
    if args.rollout == "vllm":
        import vllm

        versions["vllm"] = vllm.__version__
    result = {"impl": f"trl {trl.__version__}", "versions": versions, "rollout": args.rollout, "startup_s": startup,
              "multi": {"s": m_time, **m_counts, "metrics": metrics}, "single": {"s": s_time, **s_counts},
              "prompt_tokens_mean": statistics.mean(len(ids) for ids in prompt_ids)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"trl {args.rollout}: multi-turn {m_counts['model_tokens'] / m_time:.0f} model tokens/s, "
          f"single-turn {s_counts['model_tokens'] / s_time:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
