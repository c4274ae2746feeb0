"""The `verl-fast` command: train, bench, convert, info."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _info(args: argparse.Namespace) -> int:
    from verl_fast.info import collect, render

    print(render(collect()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-fast", description="RL post-training for LLMs with a compiled core")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="version, compiled core, CUDA architectures, optional parts")
    info.set_defaults(func=_info)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
