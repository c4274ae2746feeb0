"""8-bit AdamW states (``actor.optimizer: adamw_8bit``, torchao's AdamW8bit) against fp32 AdamW over 50 steps:
what the compression costs in accuracy, and what it saves in memory and time.

The same random-weight Qwen2 model (fp32 masters; the 0.5B shape on a GPU, a small one on the CPU) trains
from the same start on the same batches under each optimizer: next-token loss on sequences drawn from a
fixed random bigram table (a task whose loss falls in a few dozen steps), lr 1e-5, bf16 autocast on a GPU,
gradient-norm clipping 1.0. Reported per optimizer: the loss curve, its final value, the states' bytes,
the step time; between the two: the largest gap of the loss curves and the relative difference of the
total weight change, ``|dW_8bit - dW_fp32| / |dW_fp32|`` over all parameters.

    python benchmarks/bench_optimizer_states.py [--device cuda] [--steps 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, device_name  # noqa: E402

SHAPES = {"0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864),
          "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=768)}
VOCAB = 49152


def batches(steps: int, rows: int, length: int, seed: int = 0) -> List[torch.Tensor]:
    """Token sequences from a random bigram table over 512 tokens: each token's successor among 4 choices."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 512, (512, 4), generator=g)
    out = []
    for _ in range(steps):
        seq = torch.empty(rows, length, dtype=torch.long)
        seq[:, 0] = torch.randint(0, 512, (rows,), generator=g)
        for t in range(1, length):
            seq[:, t] = table[seq[:, t - 1], torch.randint(0, 4, (rows,), generator=g)]
        out.append(seq)
    return out


def train(kind: str, shape: str, data: List[torch.Tensor], device: str) -> Dict[str, object]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from verl_fast.strategies.fsdp_strategy import adamw

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=4096, **SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    start = [p.detach().clone() for p in model.parameters()]
    opt = adamw(model, 1e-5, 0.0, kind)
    autocast = torch.autocast(device, dtype=torch.bfloat16) if device == "cuda" else torch.autocast(device, enabled=False)
    losses, times = [], []
    for ids in data:
        ids = ids.to(device)
        t = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)

    def nbytes(t: torch.Tensor) -> int:
        inner = [getattr(t, a) for a in getattr(t, "__tensor_flatten__", lambda: ([], None))()[0]]
        return sum(x.numel() * x.element_size() for x in inner) if inner else t.numel() * t.element_size()

    state_bytes = sum(nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    delta = [p.detach() - s for p, s in zip(model.parameters(), start)]
    steady = sorted(times[3:]) or times
    return {"losses": losses, "state_gib": state_bytes / 2**30, "step_s": steady[len(steady) // 2],
            "delta": [d.cpu() for d in delta]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args(argv)
    shape, rows, length = ("0.5b", 8, 512) if args.device == "cuda" else ("small", 4, 64)
    data = batches(args.steps, rows, length)
    runs = {kind: train(kind, shape, data, args.device) for kind in ("adamw", "adamw_8bit")}
    ref, low = runs["adamw"], runs["adamw_8bit"]
    num = sum(float((a - b).double().pow(2).sum()) for a, b in zip(low["delta"], ref["delta"]))
    den = sum(float(b.double().pow(2).sum()) for b in ref["delta"])
    gap = max(abs(a - b) for a, b in zip(low["losses"], ref["losses"]))
    report = Report("optimizer_states", args.device)
    report.meta.update(shape=shape, tokens_per_step=rows * length, steps=args.steps, device_name=device_name(args.device),
                       losses={k: r["losses"] for k, r in runs.items()}, max_loss_gap=gap,
                       relative_update_difference=(num / den) ** 0.5 if den else None)
    for kind, r in runs.items():
        report.add(f"{shape} {args.steps} steps", kind, r["step_s"] * 1e3, extra_bytes=int(r["state_gib"] * 2**30),
                   note=f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
    path = report.save()
    print(f"saved {path}")
    print(report.table())
    print(f"loss curves' largest gap {gap:.4f}; |dW_8bit - dW_fp32| / |dW_fp32| = "
          f"{report.meta['relative_update_difference']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
