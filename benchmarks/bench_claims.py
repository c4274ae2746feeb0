"""The seeds' rollout claims, measured on this machine with the demo model (SmolLM2-135M-Instruct).

Cases (one run, one process except the HTTP server):
- ``rollout in-process vs HTTP``: the same batch (chain_sum prompts through the chat template, n
  samples each, T=1, the same max new tokens) through ``VLLMInferenceEngine`` in this process, and
  through the same vLLM started as its OpenAI-compatible server (``vllm.entrypoints.openai.api_server``)
  on 127.0.0.1, one HTTP request per prompt, all in flight at once. Median wall time per batch.
- ``P99 rollout latency``: a mixed-length prompt set (short questions and long ones) generated
  by Hugging Face ``generate`` as one padded batch, against verl_fast's length buckets
  (``rollout_buckets`` waves, short prompts first). A request's latency is the time from the
  batch's start until its wave returns; the row is the 99th percentile over requests.
- ``rollout throughput, colocated``: generated tokens/s of the engine alone, against the same engine
  after the actor model, its AdamW state and a training step share the process (and the weights were
  pushed in place); the claim is the ratio.

    python benchmarks/bench_claims.py [--prompts 4] [--n 8] [--max-new-tokens 16] [--rep 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402


def chat_prompts(tokenizer, count: int, long_every: int = 0) -> List[List[int]]:
    """chain_sum-style questions as chat-templated token ids; every ``long_every``-th is padded
    with a long preamble (a mixed-length set)."""
    out = []
    for i in range(count):
        q = f"What is {i % 9 + 1} + {(i * 7) % 9 + 1}?"
        if long_every and i % long_every == 0:
            q = "Read the numbers carefully. " * 24 + q
        msgs = [{"role": "system", "content": "Answer with just the number."}, {"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, max_len: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_len), "--enforce-eager",
           "--seed", "0"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server as vLLM ships it
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode}; the end of its log:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(2)
    proc.terminate()
    raise TimeoutError(f"the vLLM server did not answer /health within 900 s; its log: {log}")


def http_batch(port: int, model: str, prompts: List[List[int]], n: int, max_tokens: int, seed: int) -> int:
    """One request per prompt, all at once; returns the generated token count."""
    def one(i: int) -> int:
        body = {"model": model, "prompt": prompts[i], "n": n, "temperature": 1.0, "max_tokens": max_tokens,
                "seed": seed + i, "logprobs": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return int(json.loads(r.read())["usage"]["completion_tokens"])

    with ThreadPoolExecutor(len(prompts)) as pool:
        return sum(pool.map(one, range(len(prompts))))


def timed_median(fn, rep: int) -> float:
    fn()  # warm-up (the first sampled batch with log-probs compiles a helper)
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_http_vs_inprocess(report: Report, model: Path, prompts, args, work: Path) -> None:
    from verl_fast.records.generation import SamplingSpec
    from verl_fast.rollout.vllm_engine import VLLMInferenceEngine

    case = "rollout in-process vs HTTP"
    port = free_port()
    server = start_server(model, port, args.max_model_len, work / "server.log")
    try:
        http_ms = timed_median(lambda: http_batch(port, str(model), prompts, args.n, args.max_new_tokens, 1), args.rep)
    finally:
        server.terminate()
        server.wait(timeout=120)
    engine = VLLMInferenceEngine(str(model), dtype="bfloat16", max_model_len=args.max_model_len, seed=0)
    spec = SamplingSpec(n=args.n, temperature=1.0, max_tokens=args.max_new_tokens, seed=1)
    inproc_ms = timed_median(lambda: engine.generate(prompts, [spec] * len(prompts)), args.rep)
    shape = f"{len(prompts)} prompts x {args.n}, {args.max_new_tokens} new tokens"
    report.add(case, "vLLM OpenAI HTTP server", http_ms, note=shape)
    report.add(case, "verl_fast in-process vLLM", inproc_ms, note=shape)
    bench_colocated(report, engine, model, prompts, spec, args)
    engine.close()


def bench_colocated(report: Report, engine, model: Path, prompts, spec, args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    def tokens_per_s() -> float:
        t0 = time.perf_counter()
        out = engine.generate(prompts, [spec] * len(prompts))
        return float(out.response_mask.sum()) / (time.perf_counter() - t0)

    case = "rollout throughput, colocated"
    bare = statistics.median(tokens_per_s() for _ in range(args.rep))
    actor = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-6)
    ids = torch.tensor([p + p[-4:] for p in prompts[:2]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        actor(input_ids=ids).logits.float().mean().backward()
    opt.step()
    engine.update_weights(actor.state_dict().items())
    colocated = statistics.median(tokens_per_s() for _ in range(args.rep))
    # rows in ms per 1000 generated tokens, so that "faster" reads the same way as every other row
    report.add(case, "bare engine", 1e6 / bare, note=f"{bare:.0f} tokens/s")
    report.add(case, "verl_fast colocated with training", 1e6 / colocated, note=f"{colocated:.0f} tokens/s")


def bench_bucketing(report: Report, model: Path, args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.ops.schedule import rollout_buckets
    from verl_fast.records.generation import SamplingSpec
    from verl_fast.rollout.hf_engine import HFGenerateEngine

    tok = AutoTokenizer.from_pretrained(model)
    prompts = chat_prompts(tok, args.mixed_prompts, long_every=4)
    actor = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    engine = HFGenerateEngine(actor, tok, max_batch_size=len(prompts) * args.n, autocast_dtype=torch.bfloat16)
    spec = SamplingSpec(n=args.n, temperature=1.0, max_tokens=args.max_new_tokens, seed=1)
    engine.generate(prompts[:2], spec)  # warm-up

    def latencies(waves) -> List[float]:
        t0, out = time.perf_counter(), []
        for wave in waves:
            engine.generate([prompts[i] for i in wave], spec)
            out += [(time.perf_counter() - t0) * 1e3] * (len(wave) * args.n)
        return out

    def p99(values: List[float]) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]

    lens = [len(p) for p in prompts]
    plan = rollout_buckets(lens, args.max_new_tokens, max_num_seqs=len(prompts),
                           max_batch_tokens=max(lens) * len(prompts) // 2)
    waves = [[int(i) for i in w] for w in plan]
    one = [list(range(len(prompts)))]
    plain = statistics.median(p99(latencies(one)) for _ in range(args.rep))
    bucketed = statistics.median(p99(latencies(waves)) for _ in range(args.rep))
    note = f"{len(prompts)} prompts ({min(lens)}-{max(lens)} tokens) x {args.n}; {len(waves)} waves; HF generate"
    report.add("P99 rollout latency", "one batch, no bucketing", plain, note=note)
    report.add("P99 rollout latency", "verl_fast length buckets", bucketed, note=note)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu"], help="vLLM-CPU and the demo model")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--mixed-prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--rep", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="fewer prompts and repetitions")
    p.add_argument("--cases", default="http,bucketing", help="http (with colocated), bucketing")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.mixed_prompts, args.rep = 2, 8, 1
    from transformers import AutoTokenizer

    from verl_fast.models.demo import demo_model_path
    from verl_fast.rollout import vllm_compat
    from verl_fast.rollout.vllm_env import configure_vllm_env

    configure_vllm_env()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    model = demo_model_path()
    report = Report("claims", "cpu", meta={"model": "SmolLM2-135M-Instruct", "hardware": None})
    from _common import device_name

    report.meta["hardware"] = device_name("cpu")
    cases = args.cases.split(",")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="vf_claims_") as tmp:
        if "http" in cases:
            try:
                vllm_compat.import_vllm()
                prompts = chat_prompts(AutoTokenizer.from_pretrained(model), args.prompts)
                bench_http_vs_inprocess(report, model, prompts, args, Path(tmp))
                report.save()  # what is measured so far survives a later case's failure
            except ImportError as error:
                print(f"in-process vs HTTP skipped: {error}")
        if "bucketing" in cases:
            bench_bucketing(report, model, args)
    print(report.table())
    for row in report.rows:
        print(f"  {row.case:<32} {row.impl:<36} {row.note}")
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
