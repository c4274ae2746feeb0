"""Vision-language GRPO and SFT: our trainer's step against TRL's ``GRPOTrainer`` (vLLM colocate) and
``SFTTrainer`` on the same rows, in the same call, on one GPU: the step's wall time, tokens/s, our
update MFU (``perf/mfu_update``), peak memory.

The setup: a Qwen2.5-VL-3B-shaped model with random bf16 weights (``verl_fast.models.random_vlm``'s
``3b`` shape: hidden 2048, 36 layers, the 32-block vision tower; its locally trained 512-token
vocabulary) built in each run's process; one 448 x 448 random-noise picture a prompt (256 image
tokens after the 2 x 2 merge). GRPO: 16 prompts x 8 samples, up to 256 new tokens at temperature 1,
a length reward; ours with the HF rollout (the compiled, graph-captured decode: the images in its
prefill, ``rollout/cuda_graph`` 1 in each step's record when the steps replayed graphs) and, as
``ours_vllm``, with vLLM's (``rollout.type: vllm``: the images per request; GRPO only), TRL 1.16
with ``use_vllm=True, vllm_mode="colocate"``, ``beta=0`` as ours (no reference). SFT: 32 rows of a
picture, a question and a 128-word answer, the loss on the answer; ours with the defaults, TRL's
``SFTTrainer`` with its vision-language collator. The vision tower is frozen in both. Each run is its
own process; the first ``--skip`` steps are warm-up, the figures medians of the rest.

Ours prints where its time goes as it runs (a run that times out still shows it): the setup (model,
trainer, encoding), each phase of each step as it ends (``time/<phase>``), then each step's phase times,
the HF rollout's prefill and decode seconds and CUDA-graph captures, and torch.compile's graphs compiled
and graph breaks in that step. ``--set section.key=value`` (repeatable) overrides our config.

    python benchmarks/bench_vlm.py --device cuda [--algos grpo,sft] [--impls ours,ours_vllm,trl]
    python benchmarks/bench_vlm.py --device cpu --tiny     # smoke test: the tiny shape, small pictures
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
from _common import Report  # noqa: E402
from bench_e2e import profiled  # noqa: E402

QUESTION = "Describe the picture."
WORDS = "red square blue line the picture shows a large small corner left right top bottom and of".split()


def picture(size: int, seed: int):
    from PIL import Image

    return Image.frombytes("RGB", (size, size), random.Random(seed).randbytes(size * size * 3))


def sizes(args) -> Dict[str, int]:
    """Picture side, prompts, samples, new tokens, SFT rows and answer words (``--tiny``: small ones)."""
    if args.tiny:
        return dict(side=56, prompts=2, n=2, tokens=8, rows=4, words=8)
    return dict(side=448, prompts=16, n=8, tokens=256, rows=32, words=128)


def build(args):
    from verl_fast.models import random_vlm

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    # the pictures' size: trainer.image_min_pixels / image_max_pixels
    return random_vlm.build("qwen2_5_vl", "tiny" if args.tiny else "3b", 0, dtype=dtype, device=args.device)


def grpo_rows(args, trl: bool) -> List[Dict[str, Any]]:
    s = sizes(args)
    if trl:  # TRL's format: a conversational prompt with an image item, the picture in ``image``
        return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                 "image": picture(s["side"], i)} for i in range(s["prompts"] * args.steps)]
    return [{"data_source": "bench", "images": [picture(s["side"], i)], "reward_model": {"ground_truth": "0"},
             "prompt": [{"role": "user", "content": "<image>" + QUESTION}]} for i in range(s["prompts"] * args.steps)]


def sft_rows(args) -> List[Dict[str, Any]]:
    s, rng = sizes(args), random.Random(0)
    return [{"images": [picture(s["side"], i)],
             "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                          {"role": "assistant", "content": [{"type": "text", "text": " ".join(
                              rng.choice(WORDS) for _ in range(s["words"]))}]}]}
            for i in range(s["rows"] * args.steps)]


def length_reward(completions, **kwargs) -> List[float]:
    return [float(len(c if isinstance(c, str) else c[0]["content"]) % 7) for c in completions]


def synced() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def overrides(cfg: Dict[str, Any], pairs: List[str]) -> Dict[str, Any]:
    """``cfg`` with each ``section.key=value`` of ``pairs`` set (the value read as JSON where it parses)."""
    for pair in pairs:
        key, sep, value = pair.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot and name):
            raise SystemExit(f"--set {pair!r}: expected section.key=value")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        cfg.setdefault(section, {})[name] = parsed
    return cfg


def dynamo_counts() -> Dict[str, int]:
    """torch.compile's graphs compiled and graph breaks so far in this process."""
    from torch._dynamo.utils import counters

    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def live_phases(trainer, began: float, profile: Dict[str, Any]) -> None:
    """Each of the trainer's phases printed as it ends (seconds since ``began``), so that a run cut off by
    the timeout still shows how far it got; while ``profile["armed"]``, the update phase runs under the
    profiler (``bench_e2e.profiled``: kernel-busy time, top kernels and operators), its figures kept in
    ``profile["update"]``."""
    phase = trainer.perf.phase

    @contextlib.contextmanager
    def printed(name):
        start = time.perf_counter()
        watched = profile.get("armed") and name == "update_actor" and torch.cuda.is_available()
        with phase(name), (profiled(top=25, operators=True) if watched else contextlib.nullcontext()) as prof:
            yield
        if watched:
            profile["update"] = prof
        print(f"  {name}: {time.perf_counter() - start:.2f} s (at {time.perf_counter() - began:.1f} s)", flush=True)

    trainer.perf.phase = printed


def print_profile(p: Dict[str, Any]) -> None:
    print(f"ours: profiled update {p['wall_s']:.2f} s, kernels running {p['gpu_busy_s']:.2f} s ({p['kernels']} "
          f"kernels), idle in gaps >= 1 ms {p['idle']['gaps_s']:.2f} s", flush=True)
    for k in p["top_kernels"]:
        print(f"  kernel {k['total_ms']:8.1f} ms x{k['calls']:<6} {k['name'][:110]}", flush=True)
    for k in p.get("top_ops", []):
        print(f"  op     {k['kernel_ms']:8.1f} ms x{k['calls']:<6} {k['name'][:110]}", flush=True)


STEP_FIGURES = ("rollout/prefill_s", "rollout/decode_s", "rollout/graph_captures", "rollout/cuda_graph", "perf/guardrails_s",
                "perf/graph_compiles", "perf/kernel_compiles", "perf/token_budget", "perf/update_replanned")


def worker_ours(args) -> Dict[str, Any]:
    """Our trainer's steps; ``--run ours_vllm``: GRPO's rollout through vLLM."""
    from verl_fast.trainer.rl_trainer import RLTrainer

    began = time.perf_counter()
    model, processor = build(args)
    print(f"ours {args.algo}: model built in {time.perf_counter() - began:.1f} s", flush=True)
    s = sizes(args)
    side = s["side"] * s["side"]
    trainer_cfg = {"total_steps": args.steps, "progress_bar": False, "plot": False, "device": args.device,
                   "output_dir": tempfile.mkdtemp(prefix="bench_vlm_ours_"), "image_min_pixels": side,
                   "image_max_pixels": side}
    if args.algo == "grpo":
        cfg = {"algorithm": {"type": "grpo"}, "actor": {"lr": 1e-6},
               "rollout": {"type": "vllm" if args.run == "ours_vllm" else "hf", "n": s["n"], "max_new_tokens": s["tokens"], "temperature": 1.0},
               "trainer": {**trainer_cfg, "train_batch_size": s["prompts"], "max_prompt_length": 512}}
        trainer = RLTrainer(actor_model=model, tokenizer=processor, reward_fn=length_reward,
                            config=overrides(cfg, args.set))
        items = trainer.processor.encode_all(grpo_rows(args, trl=False))
        per = s["prompts"]
    else:
        cfg = {"algorithm": {"type": "sft", "sft_max_length": 1024}, "actor": {"lr": 1e-6},
               "trainer": {**trainer_cfg, "train_batch_size": s["rows"]}}
        trainer = RLTrainer(actor_model=model, tokenizer=processor, config=overrides(cfg, args.set))
        items = trainer.algorithm.encode(trainer.processor, sft_rows(args))
        per = s["rows"]
    print(f"ours {args.algo}: trainer built and rows encoded at {time.perf_counter() - began:.1f} s", flush=True)
    profile: Dict[str, Any] = {}
    live_phases(trainer, began, profile)
    trainer.total_steps = args.steps + args.profile
    steps = []
    for i in range(args.steps + args.profile):
        profile["armed"] = i >= args.steps  # the extra step: its update profiled, not timed
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        before = dynamo_counts()
        start = synced()
        try:
            metrics = trainer.train_step(items[i % args.steps * per : (i % args.steps + 1) * per])
        except torch.OutOfMemoryError:  # what held the memory, for the run's log
            u = trainer.updates
            print(f"ours {args.algo}: out of memory at step {i + 1}: token budget {u.auto_budget or trainer.cfg.actor.max_token_len_per_gpu}, "
                  f"checkpointing {getattr(trainer.strategy, 'checkpointing', None)}, compiled blocks "
                  f"{getattr(trainer.strategy, 'compiled', None)}, {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, "
                  f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB\n"
                  f"{torch.cuda.memory_summary(abbreviated=True)}", flush=True)
            raise
        wall = synced() - start
        if profile.get("armed"):
            if "update" in profile:
                print_profile(profile["update"])
            continue
        after = dynamo_counts()
        steps.append({"wall_s": wall, "mfu_update": metrics.get("perf/mfu_update"), "peak_memory_gib": peak_gib(),
                      "response_length": metrics.get("response/length"), "tokens": metrics.get("perf/tokens"),
                      "cuda_graph": metrics.get("rollout/cuda_graph"),
                      "phases_s": {k[5:]: round(v, 3) for k, v in metrics.items() if k.startswith("time/")},
                      **{k.split("/")[1]: metrics[k] for k in STEP_FIGURES if k in metrics},
                      **{f"step_{k}": after[k] - before[k] for k in after}})
        print(f"ours {args.algo}: step {i + 1} {wall:.2f} s {steps[-1]}", flush=True)
    return {"impl": "verl_fast", "steps": steps, **({"update_profile": profile["update"]} if "update" in profile else {})}


def never_placeholders(folder: Path, vllm: bool) -> Dict[str, Any]:
    """TRL's sampling kept off the image / video placeholder ids, as ours is (``models/vision.placeholder_ids``):
    a random model samples them, and TRL's passes then find more placeholders than image features and stop. The
    same ban through vLLM's ``logit_bias`` (our vLLM engine's) or transformers' ``suppress_tokens`` (our HF
    engine's)."""
    from transformers import AutoConfig

    from verl_fast.models.vision import config_placeholder_ids

    ids = config_placeholder_ids(AutoConfig.from_pretrained(folder))
    return {"logit_bias": {i: -100.0 for i in ids}} if vllm else {"suppress_tokens": ids}


def worker_trl(args) -> Dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import AutoProcessor, TrainerCallback

    from verl_fast.models import random_vlm

    began = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="bench_vlm_model_"))
    # TRL loads the model and its processor from the folder
    random_vlm.save(folder, "qwen2_5_vl", "tiny" if args.tiny else "3b", device=args.device)
    processor = AutoProcessor.from_pretrained(folder)  # transformers' Qwen2.5-VL processor (needs torchvision)
    side = sizes(args)["side"] ** 2
    processor.image_processor.min_pixels = processor.image_processor.max_pixels = side
    s = sizes(args)

    class Timer(TrainerCallback):
        def __init__(self):
            self.steps: List[Dict[str, float]] = []

        def on_step_begin(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self.start = synced()

        def on_train_begin(self, *a, **k):
            print(f"trl {args.algo}: training begins at {time.perf_counter() - began:.1f} s", flush=True)

        def on_step_end(self, *a, **k):
            self.steps.append({"wall_s": synced() - self.start, "peak_memory_gib": peak_gib()})
            print(f"trl {args.algo}: step {len(self.steps)} {self.steps[-1]['wall_s']:.2f} s", flush=True)

    common = dict(output_dir=tempfile.mkdtemp(prefix="bench_vlm_trl_"), learning_rate=1e-6, max_steps=args.steps,
                  logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                  bf16=args.device == "cuda", use_cpu=args.device == "cpu")
    timer = Timer()
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.algo == "grpo":
        # micro-batches of 16 completions, 8 of them a step: one generation of 16 prompts x 8 (bench_e2e's TRL runs)
        config = trl.GRPOConfig(per_device_train_batch_size=s["prompts"], gradient_accumulation_steps=s["n"],
                                num_generations=s["n"],
                                max_completion_length=s["tokens"], temperature=1.0, beta=0.0,
                                use_vllm=args.device == "cuda", vllm_mode="colocate",
                                generation_kwargs=never_placeholders(folder, args.device == "cuda"),
                                model_init_kwargs={"dtype": dtype}, **common)
        trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=length_reward, args=config, callbacks=[timer],
                                  train_dataset=Dataset.from_list(grpo_rows(args, trl=True)),
                                  processing_class=processor)
    else:
        config = trl.SFTConfig(per_device_train_batch_size=s["rows"], max_length=None, model_init_kwargs={"dtype": dtype},
                               dataset_num_proc=1, **common)
        trainer = trl.SFTTrainer(model=str(folder), args=config, train_dataset=Dataset.from_list(sft_rows(args)),
                                 processing_class=processor, callbacks=[timer])
    for name, p in trainer.model.named_parameters():  # the vision tower frozen, as ours by default
        if ".visual." in f".{name}":
            p.requires_grad_(False)
    trainer.train()
    return {"impl": f"trl {trl.__version__}", "steps": timer.steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--algos", default="grpo,sft")
    ap.add_argument("--impls", default="ours,trl")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape and small pictures (CPU smoke test)")
    ap.add_argument("--profile", type=int, choices=(0, 1), default=0,
                    help="1: ours runs one more step, its update under the profiler (top kernels and operators)")
    ap.add_argument("--name", default="vlm", help="the report's name (results/<name>_<device>.json)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="our config's key set to VALUE (JSON where it parses), e.g. rollout.hf_compile_decode=false")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # a worker: impl
    ap.add_argument("--algo", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run:
        result = (worker_ours if args.run in ("ours", "ours_vllm") else worker_trl)(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    report = Report(args.name + ("_tiny" if args.tiny else ""), args.device)
    report.meta.update(steps=args.steps, skip=args.skip, sizes=sizes(args), shape="tiny" if args.tiny else "3b")
    for algo in args.algos.split(","):
        case = f"{algo} step ms"
        for impl in args.impls.split(","):
            if impl == "ours_vllm" and algo != "grpo":
                continue  # no rollout in SFT: the same run as ours
            out = Path(tempfile.mkdtemp(prefix="bench_vlm_")) / "result.json"
            cmd = [sys.executable, __file__, "--run", impl, "--algo", algo, "--out", str(out), "--device",
                   args.device, "--steps", str(args.steps), "--profile", str(args.profile)] + (["--tiny"] if args.tiny else []) + \
                [f"--set={pair}" for pair in args.set]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired as stopped:
                said = "".join(t.decode(errors="replace") if isinstance(t, bytes) else t
                               for t in (stopped.stdout or "", stopped.stderr or ""))
                print(f"{algo} {impl}: timed out after {args.timeout} s\n{said[-3000:]}", flush=True)
                continue
            if done.returncode != 0 or not out.is_file():
                # each stream's own tail: the worker's last lines (ours: its out-of-memory report) above the traceback
                print(f"{algo} {impl}: failed\n{done.stdout[-2500:]}\n{done.stderr[-2500:]}", flush=True)
                continue
            print(done.stdout[-4000:], end="", flush=True)  # the worker's own lines (ours: its phases and steps)
            result = json.loads(out.read_text())
            timed = result["steps"][min(args.skip, len(result["steps"]) - 1):]
            wall = statistics.median(s["wall_s"] for s in timed)
            mfu = [s["mfu_update"] for s in timed if s.get("mfu_update")]
            note = f"peak {max(s['peak_memory_gib'] for s in timed):.1f} GiB" + \
                (f", update MFU {100 * statistics.median(mfu):.1f}%" if mfu else "")
            name = {"ours": "verl_fast (ours)", "ours_vllm": "verl_fast (ours, vLLM rollout)"}.get(impl) or result["impl"] + \
                (" GRPOTrainer (vLLM colocate)" if algo == "grpo" else " SFTTrainer")
            report.add(case, name, wall * 1e3, note=note)
            report.meta[f"{algo}/{impl}"] = {"wall_s": wall, "steps": timed,
                                             **{k: result[k] for k in ("update_profile",) if k in result}}
            print(f"{algo} {name}: {wall:.2f} s/step, {note}", flush=True)
    print(report.table())
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
