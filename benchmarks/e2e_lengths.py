"""bench_e2e at users' lengths (``--lengths ragged`` and the real demo model, ``--shapes demo``): the responses'
lengths each run produced, its decode against the decode's floor, and the table of these rows.

Ragged rows: the random-weight model carries ``verl_fast.bench.lengths``' mechanism in its weights, calibrated
for the cap (``--tokens``) over the run's own prompts, so ours and TRL's runs load the same files and sample
the same distribution; nothing in either run knows the lengths. Each run records every step's per-row
response lengths (ours: the rollout's response mask; TRL's: the ``completion_ids`` its reward receives).

Per run: generated tokens per second of step (and, ours, of the generation phase), the decode steps a static
batch needs (the longest row of each step) against the tokens generated (``decode_fill``: tokens / (rows x
longest): the share of a static batch's slots holding a live row), the distribution (median, p90, p99, max,
fraction at the cap), and ours' generation beside its floor: the bf16 weights read once per decode step for
the steps the longest row needs, plus every row's KV cache read once per token it generates, at the GPU's
stated memory bandwidth.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from verl_fast.bench import lengths

DEMO_SYSTEM = "Think step by step, then end with the final answer as a number."


def demo_rows(count: int, seed: int = 0) -> List[Dict[str, Any]]:
    """The demo task: sums of two to four numbers below 100, in the chat form, with their answers."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(count):
        terms = [rng.randint(1, 99) for _ in range(2 + i % 3)]
        out.append({"prompt": [{"role": "system", "content": DEMO_SYSTEM},
                               {"role": "user", "content": f"What is {' + '.join(map(str, terms))}?"}],
                    "answer": str(sum(terms))})
    return out


def last_number_is(text: str, answer: str) -> float:
    """1.0 when the last number in ``text`` equals ``answer`` (the demo task's reward), else 0.0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return float(bool(numbers) and float(numbers[-1]) == float(answer))


def install(model, tokenizer, prompts: Sequence[Sequence[int]], cap: int) -> Dict[str, Any]:
    """The mechanism calibrated for ``cap`` over ``prompts`` written into ``model``; its parameters and the
    distribution they predict."""
    spec = lengths.spec_for(prompts, tokenizer, len(tokenizer), cap)
    lengths.install(model, tokenizer, spec)
    digits = lengths.digit_tokens(tokenizer)
    rates = [lengths.prompt_rate(p, digits, spec, len(tokenizer)) for p in prompts]
    return {"bias": spec.bias, "spread": spec.spread, "seed": spec.seed, "predicted": lengths.predicted(rates, cap)}


def record_rollouts(trainer) -> List[List[int]]:
    """Every later rollout of ``trainer`` appends its rows' response lengths to the list returned."""
    seen: List[List[int]] = []
    rollout = trainer.rollout.rollout

    def recorded(*args, **kwargs):
        out = rollout(*args, **kwargs)
        seen.append(lengths.measured_lengths(out.response_mask))
        return out

    trainer.rollout.rollout = recorded
    return seen


def recording_reward(score: Callable[..., List[float]], seen: List[List[int]]) -> Callable[..., List[float]]:
    """A TRL reward function that records the lengths of the completions it scores, then scores them."""

    def reward(completions, completion_ids=None, **kwargs):
        if completion_ids is not None:
            seen.append([len(ids) for ids in completion_ids])
        return score(completions, **kwargs)

    return reward


def kv_bytes_per_token(cfg: Dict[str, Any]) -> int:
    """bf16 K and V of one token over all layers."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim


def decode_floor_s(weight_bytes: float, cfg: Dict[str, Any], prompt_tokens: float, rows: Sequence[int],
                   bandwidth: float) -> float:
    """The decode's floor for one step's rows (their lengths ``rows``): the weights read once per decode step
    for the steps the longest row needs, and each row's KV cache (prompt + tokens so far) read once per token."""
    kv = kv_bytes_per_token(cfg) * sum(n * prompt_tokens + n * (n - 1) / 2 for n in rows)
    return (weight_bytes * max(rows, default=0) + kv) / bandwidth


def summarise(per_step: List[List[int]], skip: int, cap: int, step_s: Optional[float],
              gen_s: Optional[float] = None, floor: Optional[Callable[[Sequence[int]], float]] = None) -> Dict[str, Any]:
    """The length figures of a run's steady steps (``per_step``: every step's row lengths, warm-up first)."""
    steady = per_step[skip:] or per_step
    if not steady:
        return {}
    rows = [n for step in steady for n in step]
    tokens = statistics.median(sum(step) for step in steady)
    longest = statistics.median(max(step) for step in steady)
    out = {"distribution": lengths.figures(rows, cap), "generated_tokens_per_step": tokens,
           "decode_steps": longest, "decode_fill": statistics.median(sum(s) / (len(s) * max(s)) for s in steady),
           "generated_tokens_per_s_of_step": tokens / step_s if step_s else None,
           "generated_tokens_per_s_of_generation": tokens / gen_s if gen_s else None}
    if floor is not None:
        out["decode_floor_s"] = statistics.median(floor(step) for step in steady)
        out["generation_over_floor"] = gen_s / out["decode_floor_s"] if gen_s and out["decode_floor_s"] else None
    return out


def demo_folder(gguf: Optional[str], models: Path) -> Path:
    """The real demo model's HF folder: converted from ``gguf`` into ``models``/demo (the GPU machine, where the
    GGUF is carried), or the installed package's (``verl_fast.models.demo``)."""
    from verl_fast.models import demo

    if not gguf:
        return demo.demo_model_path()
    folder = models / "demo"
    if not demo.is_complete(folder):
        demo.convert_gguf(Path(gguf), folder)
    return folder


def run_figures(run: Dict[str, Any], summary: Dict[str, Any], skip: int, cap: int, model_cfg: Dict[str, Any],
                bandwidth: Optional[float]) -> Dict[str, Any]:
    """``summarise`` of one bench_e2e run; ours' generation against its floor where ``bandwidth`` is given."""
    ours = "params" in run
    gen = (summary.get("phases_s") or {}).get("generation") if ours else None
    floor = None
    if ours and bandwidth:
        floor = lambda rows: decode_floor_s(2.0 * run["params"], model_cfg, run["prompt_tokens_mean"],  # noqa: E731
                                            rows, bandwidth)  # bf16 weights
    return summarise(run["lengths"], skip, cap, summary.get("step_s"), gen, floor)


def table(report) -> List[str]:
    """The ragged / demo rows of a report: one line a run."""
    lines = []
    for label, meta in report.meta.items():
        if not isinstance(meta, dict) or not meta.get("lengths_mechanism") and not label.startswith("demo"):
            continue
        trl = (meta["runs"].get("trl_vllm") or {}).get("step_s")
        for key, s in meta["runs"].items():
            got = s.get("lengths") or {}
            d = got.get("distribution") or {}
            if s.get("step_s") is None or not d:
                continue
            fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
            gen = (s.get("phases_s") or {}).get("generation")
            lines.append(
                f"{label:<16} {key:<9} step {s['step_s']:6.2f} s  /TRLvLLM {fmt(s['step_s'] / trl if trl else None, '.2f')}"
                f"  gen {fmt(gen, '.2f')} s (floor {fmt(got.get('decode_floor_s'), '.3f')} s, "
                f"x{fmt(got.get('generation_over_floor'), '.1f')})  gen tok/s {fmt(got.get('generated_tokens_per_s_of_generation'), '.0f')}"
                f" (of step {fmt(got.get('generated_tokens_per_s_of_step'), '.0f')})  decode steps "
                f"{got['decode_steps']:.0f} for {got['generated_tokens_per_step']:.0f} tokens (fill "
                f"{got['decode_fill']:.2f})  lengths median {d['median']} p90 {d['p90']} p99 {d['p99']} max {d['max']} "
                f"at cap {100 * d['at_cap']:.1f}%  peak {fmt(s.get('peak_memory_gib'), '.1f')} GiB")
    return lines
