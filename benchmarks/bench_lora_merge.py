"""The LoRA merge that precedes each rollout of the compiled decode: every adapted layer's
``W + scale * B @ A`` written into the decode's kept bf16 copies (``hf_decode.merge_adapters``).

Rows, all on the same peft model (bf16 base, peft's float32 adapters, r 64 on every linear layer):
- ``verl_fast merge_adapters``: the copies refreshed in place (the base copied in, one ``addmm_`` per
  adapter), the adapted layers put back after;
- ``float32 sum, then cast``: the merge as it was before 2026-12-06 (the base, the product and the sum
  in float32 temporaries, cast into the copy), timed to show what the change removed;
- ``peft merge + unmerge``: peft's own way to run on merged weights and give the trainer its base back
  (``merge()`` then ``unmerge()`` on every layer, in place); ``max err`` is the base's drift after one
  round, which bf16 cannot undo exactly.
The floor reads the base and writes the copy once (4 bytes a weight in bf16) at the card's HBM speed.

    python benchmarks/bench_lora_merge.py --device cuda [--shape 7b] [--rank 64]
    python benchmarks/bench_lora_merge.py --device cpu --shape small
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, copy_bandwidth_gbs, hbm_bytes_per_s, time_ms  # noqa: E402
from bench_e2e import SHAPES  # noqa: E402


def build(shape: str, rank: int, device: str):
    import peft
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=151936 if shape == "7b" else 4096, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # peft starts B at zero
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default=None, help="of bench_e2e's shapes (7b on a GPU, small on the CPU)")
    p.add_argument("--rank", type=int, default=64)
    args = p.parse_args(argv)
    shape = args.shape or ("7b" if args.device == "cuda" else "small")
    from verl_fast.rollout.hf_decode import merge_adapters

    torch.set_grad_enabled(False)
    model = build(shape, args.rank, args.device)
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    weights = sum(m.base_layer.weight.numel() for m in layers)
    copies: dict = {}

    def ours():
        merge_adapters(model, torch.bfloat16, copies, done := [])
        for parent, attr, adapted in done:
            setattr(parent, attr, adapted)

    before = {id(m): torch.empty_like(m.base_layer.weight) for m in layers}

    def float32_sum():
        for m in layers:
            delta = (m.lora_B["default"].weight.float() @ m.lora_A["default"].weight.float()) * m.scaling["default"]
            before[id(m)].copy_((m.base_layer.weight.float() + delta).to(torch.bfloat16))

    def peft_round():
        for m in layers:
            m.merge()
        for m in layers:
            m.unmerge()

    case = f"LoRA merge {shape} r{args.rank}"
    report = Report("lora_merge", args.device)
    report.meta = {"shape": shape, "rank": args.rank, "adapted_layers": len(layers), "adapted_weights": weights}
    bandwidth = hbm_bytes_per_s() if args.device == "cuda" else copy_bandwidth_gbs(args.device) * 1e9
    report.floors[case] = 4 * weights / bandwidth * 1e3
    ms = time_ms(ours, args.device, warmup=2, rep=5)
    report.add(case, "verl_fast merge_adapters", ms, max_err=0.0, note="the base untouched")
    report.add(case, "float32 sum, then cast", time_ms(float32_sum, args.device, warmup=1, rep=5),
               note="the merge before 2026-12-06")
    base = layers[0].base_layer.weight.clone()
    peft_round()
    drift = (layers[0].base_layer.weight.float() - base.float()).abs().max().item()
    report.add(case, "peft merge + unmerge", time_ms(peft_round, args.device, warmup=1, rep=5), max_err=drift,
               note="max err: the base's drift after one round (first layer)")
    report.save()
    print(report.table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
