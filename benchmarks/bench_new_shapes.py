"""What a training pass pays the first time it meets a token count: a bf16 linear layer forward +
backward (cuBLAS) and torch's varlen flash attention forward + backward, at token counts it has not
seen, against the same call repeated. Packed micro-batches (``actor.use_remove_padding``) have a new
token count almost every step, so a per-shape cost here is paid inside steady steps; bucketed counts
(``models/packed.bucket``) repeat.

    python benchmarks/bench_new_shapes.py --device cuda [--hidden 896 --intermediate 4864]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda"])
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--tokens", default="33001,33217,33433,33650,33866,34081", help="new token counts, in turn")
    args = p.parse_args(argv)
    from verl_fast.models.packed import bucket

    device = torch.device(args.device)
    linear = torch.nn.Linear(args.hidden, args.intermediate, device=device, dtype=torch.bfloat16)
    head_dim = args.hidden // args.heads

    def linear_pass(n: int) -> None:
        x = torch.randn(n, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        linear(x).sum().backward()

    def attention_pass(n: int) -> None:
        from torch.nn.attention.varlen import varlen_attn

        q = torch.randn(n, args.heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(n, args.heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        cu = torch.tensor([0, n // 3, n], dtype=torch.int32, device=device)
        varlen_attn(q, kv, kv, cu, cu, n - n // 3, n - n // 3, window_size=(-1, 0)).sum().backward()

    report = Report("new_shapes", args.device)
    linear_pass(4096), attention_pass(4096)  # libraries loaded, handles made
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        for name, fn in (("linear", linear_pass), ("varlen attention", attention_pass)):
            for label, size in (("exact", n), ("bucketed", bucket(n))):
                first, again = timed(lambda: fn(size)), timed(lambda: fn(size))
                rows.append({"op": name, "count": label, "tokens": size, "first_ms": first, "again_ms": again})
                print(f"{name:<17} {label:<8} {size:>6} tokens: first call {first:8.2f} ms, again {again:7.2f} ms",
                      flush=True)
    report.meta.update(hidden=args.hidden, intermediate=args.intermediate, heads=args.heads, rows=rows)
    for name in ("linear", "varlen attention"):
        for label in ("exact", "bucketed"):
            sel = [r for r in rows if r["op"] == name and r["count"] == label]
            extra = sum(r["first_ms"] - r["again_ms"] for r in sel) / len(sel)
            report.add(f"{name} first call at a new count, extra", label, extra)
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
