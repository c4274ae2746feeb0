"""Rollout: vLLM (in-process VLLMInferenceEngine) vs Hugging Face ``generate``, and in-place weight updates.

Cases, all in one process and one run:
- ``gen <model>``: P prompts x n samples x T new tokens (EOS ignored, so both engines produce exactly
  the same number of tokens), sampled at temperature 1 with the sampled tokens' log-probs; time of
  the whole batch and generated tokens/s; vLLM with its per-step detokenisation and without it (the
  texts decoded in one batch after generation, as the trainer's requests run). Models: the tiny
  random-weight Qwen2 of the tests, and the demo model SmolLM2-135M-Instruct (``--models tiny,demo``).
- ``update <model>``: ``update_weights(model.state_dict().items())`` into the running engine, against
  building a new engine from the saved folder (what an update without in-place loading costs) and
  against the floor: one copy of the weights' bytes at the measured memory bandwidth.

    python benchmarks/bench_rollout.py [--models tiny,demo] [--device cpu|cuda] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests" / "support"))
from _common import Report, copy_bandwidth_gbs, time_ms  # noqa: E402

SIZES = {"tiny": dict(prompts=32, n=4, tokens=64), "demo": dict(prompts=8, n=4, tokens=32)}


def model_folder(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from tiny_models import save_tiny_model

        return save_tiny_model(workdir / "tiny", family="qwen2", num_layers=4, hidden_size=256, num_heads=4,
                               num_kv_heads=2, intermediate_size=512, vocab_size=2048)
    if name == "demo":
        from verl_fast.models.demo import demo_model_path

        return demo_model_path()
    return Path(name)


def make_prompts(tokenizer, count: int):
    """Chat-templated arithmetic questions of a few lengths (the demo's kind of prompt)."""
    out = []
    for i in range(count):
        question = f"What is {i % 10} + {(3 * i) % 10}?" + " Think step by step." * (i % 3)
        messages = [{"role": "system", "content": "Answer with just the number."},
                    {"role": "user", "content": question}]
        out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    return [list(p) for p in out]


def hf_generate(model, prompts, n: int, tokens: int, pad_id: int, device: str) -> int:
    """Left-padded batched sampling with log-probs of the sampled tokens; returns tokens generated."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.repeat_interleave(n, 0).to(device), mask.repeat_interleave(n, 0).to(device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad_id,
                             output_scores=True, return_dict_in_generate=True)
        new = out.sequences[:, width:]
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        sampled_logp = logp.gather(-1, new.unsqueeze(-1))  # what the vLLM engine returns too
    return int(sampled_logp.numel())


def bench_model(name: str, args, report: Report, workdir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.rollout.vllm_engine import VLLMInferenceEngine

    folder = model_folder(name, workdir)
    size = SIZES.get(name, SIZES["demo"])
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = make_prompts(tokenizer, size["prompts"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()
    storages = {t.data_ptr(): t.numel() * t.element_size() for t in hf.state_dict().values()}
    nbytes = sum(storages.values())  # tied embeddings counted once
    case = f"{name} P{size['prompts']}xn{size['n']}xT{size['tokens']}"

    torch._C.set_num_threads(args.threads)  # HF generate on the same thread count as the engine
    hf_ms = time_ms(lambda: hf_generate(hf, prompts, size["n"], size["tokens"], pad_id, args.device),
                    args.device, warmup=1, rep=args.rep)
    total = size["prompts"] * size["n"] * size["tokens"]
    report.add(f"gen {case}", "HF generate", hf_ms, note=f"{total / hf_ms * 1e3:.0f} tok/s")

    engine = VLLMInferenceEngine(folder, dtype=args.dtype, max_model_len=512, max_num_seqs=256,
                                 kv_cache_memory_bytes=args.kv_cache_mib << 20, cpu_threads=args.threads)
    init_s = engine.init_seconds
    import vllm

    params = vllm.SamplingParams(n=size["n"], temperature=1.0, max_tokens=size["tokens"], ignore_eos=True,
                                 logprobs=0, seed=0)
    made = engine.generate(prompts, params)
    assert int(made.response_mask.sum()) == total
    v_ms = time_ms(lambda: engine.generate(prompts, params), args.device, warmup=1, rep=args.rep)
    report.add(f"gen {case}", f"verl_fast vLLM {args.device}", v_ms, note=f"{total / v_ms * 1e3:.0f} tok/s")
    # the trainer's requests (no stop strings): vLLM's per-step detokenisation off, one batch decode after
    quiet = params.clone()
    quiet.detokenize = False
    assert engine.generate(prompts, quiet).texts == made.texts
    q_ms = time_ms(lambda: engine.generate(prompts, quiet), args.device, warmup=1, rep=args.rep)
    report.add(f"gen {case}", f"verl_fast vLLM {args.device}, texts by one batch decode", q_ms,
               note=f"{total / q_ms * 1e3:.0f} tok/s")

    state = hf.state_dict()
    up_ms = time_ms(lambda: engine.update_weights(state.items()), args.device, warmup=1, rep=args.rep)
    report.add(f"update {name}", "verl_fast update_weights", up_ms, note=f"{nbytes / 2**20:.0f} MiB")
    report.add(f"update {name}", "new engine (LLM init)", init_s * 1e3, note="restart instead of in-place")
    report.floors[f"update {name}"] = 2 * nbytes / (args.bandwidth_gbs * 1e9) * 1e3
    report.meta[name] = {"folder": str(folder), "parameters": sum(p.numel() for p in hf.parameters()),
                         "weight_bytes": nbytes, "prompt_tokens": [len(p) for p in prompts], **size,
                         "hf_tokens_per_s": total / hf_ms * 1e3, "vllm_tokens_per_s": total / v_ms * 1e3,
                         "vllm_init_s": init_s, "update_ms": up_ms}
    engine.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,demo", help="comma list: tiny, demo, or HF folders")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rep", type=int, default=3)
    p.add_argument("--kv-cache-mib", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU) for both engines")
    args = p.parse_args(argv)

    from verl_fast.rollout import vllm_compat
    from verl_fast.rollout.vllm_env import configure_vllm_env

    configure_vllm_env()
    try:
        vllm_compat.import_vllm()
    except ImportError as error:
        print(f"bench_rollout: skipped, {error}")
        return 0
    args.bandwidth_gbs = copy_bandwidth_gbs(args.device)
    report = Report("rollout", args.device, meta={"dtype": args.dtype, "vllm": vllm_compat.version(),
                                                  "threads": args.threads,
                                                  "copy_bandwidth_gbs": args.bandwidth_gbs})
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            bench_model(name, args, report, Path(tmp))
    print(report.table())
    for row in report.rows:
        if row.note:
            print(f"  {row.case:<28} {row.impl:<26} {row.note}")
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
