"""The `verl-fast` command: train, bench, convert, export, info."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional


def _info(args: argparse.Namespace) -> int:
    from verl_fast.cli.info import collect, render

    print(render(collect()))
    return 0


def _train(args: argparse.Namespace) -> int:
    import gc

    # Start-up (imports, models, the engine) makes about a million long-lived objects, which the
    # cyclic collector sweeps whole again each time they grow by a quarter: 14 full sweeps, 3.5 s of
    # the default run's 11 s start-up on 2 cores. It is off until the trainer is built; run() then
    # freezes what exists (never swept again) and turns it back on.
    gc.disable()
    from verl_fast.cli.train import run

    try:
        return run(args)
    finally:
        gc.enable()


def _bench(args: argparse.Namespace) -> int:
    from verl_fast.bench.runner import run

    return run(args)


def _shard_gb(text: str) -> float:
    """--max-shard-gb: a finite size above 0 (nan, inf, 0 and negatives refused by argparse, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0 or value * (1 << 30) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard size in GiB above 0 (e.g. 5)")
    return value


def _convert(args: argparse.Namespace) -> int:
    import torch

    from verl_fast.strategies.megatron.convert import convert_megatron_to_hf

    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = convert_megatron_to_hf(args.checkpoint, args.output, args.tp, args.pp, config=args.config, dtype=dtype,
                                 max_shard_bytes=int(args.max_shard_gb * (1 << 30)), overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from verl_fast.checkpoint.sharded import export

    out = export(args.checkpoint, args.output, max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
                 overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-fast", description="RL post-training for LLMs with a compiled core")
    sub = p.add_subparsers(dest="command", required=True)
    from verl_fast.cli.train import add_arguments

    train = sub.add_parser("train", help="run an RL job (no --config: the embedded default run)")
    add_arguments(train)
    train.set_defaults(func=_train)
    sft = sub.add_parser("sft", help="verl's SFT trainer command line (torchrun -m verl.trainer.fsdp_sft_trainer "
                                     "key=value ...) as algorithm.type=sft, with verl's SFT defaults")
    add_arguments(sft)
    sft.set_defaults(func=_train, tree="sft")
    bench = sub.add_parser("bench", help="benchmarks on this device against their baselines, the floors and the "
                                         "A100 design targets: one table, JSON, Markdown and PNG (--out)")
    from verl_fast.bench.runner import add_arguments as bench_arguments

    bench_arguments(bench)
    bench.set_defaults(func=_bench)
    info = sub.add_parser("info", help="version, compiled core, CUDA architectures, optional parts")
    info.set_defaults(func=_info)
    conv = sub.add_parser("convert", help="Megatron checkpoint (legacy mp_rank_* or torch_dist) -> HF safetensors folder")
    conv.add_argument("checkpoint", help="checkpoint root (with latest_checkpointed_iteration.txt) or iteration folder")
    conv.add_argument("output", help="HF folder to write (new or empty; written under a temporary name, then renamed)")
    conv.add_argument("--tp", type=int, default=None, help="tensor-parallel size (legacy; inferred if omitted)")
    conv.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (legacy; inferred if omitted)")
    conv.add_argument("--config", default=None,
                      help="HF config folder or config.json of the architecture (default: Megatron-LM's saved args)")
    conv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                      help="output dtype (default: the checkpoint's)")
    conv.add_argument("--max-shard-gb", type=_shard_gb, default=5.0, help="safetensors shard size limit")
    conv.add_argument("--overwrite", action="store_true",
                      help="write into a folder that holds files: replaces only the files the conversion writes")
    conv.set_defaults(func=_convert)
    exp = sub.add_parser("export", help="training checkpoint (sharded) -> HF safetensors folder (transformers, vLLM)")
    exp.add_argument("checkpoint", help="a checkpoints/step_N folder, or a run's output_dir (its newest complete one)")
    exp.add_argument("output", help="HF folder to write (new or empty, outside the run; written under a temporary "
                                    "name, then renamed)")
    exp.add_argument("--max-shard-gb", type=_shard_gb, default=5.0, help="safetensors shard size limit")
    exp.add_argument("--overwrite", action="store_true",
                     help="write into a folder that holds files: replaces only the files an export writes")
    exp.set_defaults(func=_export)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Runs a subcommand under the error policy of ``verl_fast.errors``: an expected failure is one
    line on stderr and exit 2, only a bug shows a traceback."""
    from verl_fast.errors import guarded

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # options may come anywhere among train's key=value overrides (argparse ends the positionals at the
    # first option): the overrides after it are taken here; anything else is still an error
    stray = [a for a in extra if a.startswith("-") and not a.startswith("~")]
    if stray or (extra and not hasattr(args, "assignments")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.assignments = list(args.assignments) + extra
    return guarded(args.command, args.func, args)


def program() -> None:
    """The ``verl-fast`` program: ``main`` on the command line, then out of the process without the
    interpreter's own teardown. Everything a command writes is closed when it returns and the exit
    handlers still run; what is skipped is freeing every module and tensor one by one, and the vLLM
    engines' shutdown, which writes nothing either (their time: docs/benchmarks.md)."""
    import atexit

    from verl_fast import openmp_env

    openmp_env.use()  # before anything imports torch
    import logging

    # torchao, where installed (actor.optimizer=adamw_8bit), is imported by transformers' quantizers at
    # start: its notes on the CUDA extensions it cannot load on a CPU machine (and torch's on its enums)
    # say nothing about the run
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        code = main()
    except SystemExit as e:  # argparse errors, --help, SystemExit("message")
        code = e.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    vllm_engine = sys.modules.get("verl_fast.rollout.vllm_engine")
    if vllm_engine is not None:  # the engines' shutdown only frees memory, which the exit below frees
        vllm_engine.leave_engines_to_exit()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    program()
