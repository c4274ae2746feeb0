"""The `verl-fast` command: train, bench, convert, info."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _info(args: argparse.Namespace) -> int:
    from verl_fast.info import collect, render

    print(render(collect()))
    return 0


def _train(args: argparse.Namespace) -> int:
    from verl_fast.train_cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-fast", description="RL post-training for LLMs with a compiled core")
    sub = p.add_subparsers(dest="command", required=True)
    from verl_fast.train_cli import add_arguments

    train = sub.add_parser("train", help="run an RL job (no --config: the embedded default run)")
    add_arguments(train)
    train.set_defaults(func=_train)
    info = sub.add_parser("info", help="version, compiled core, CUDA architectures, optional parts")
    info.set_defaults(func=_info)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
