"""The DPO example's data without the hub: arithmetic preference pairs -> data/rl_dataset.pt.

    python examples/dpo/build_local_dataset.py
    verl-fast train --config examples/dpo/config.yaml --dataset_path ./data/rl_dataset.pt \\
        --set actor.model_name=smollm2-135m-instruct

The offline twin of build_dataset.py (which reads webgpt_comparisons from the hub): each pair asks
"What is a + b?" and prefers the right sum, stated, over a wrong one; ``--tokenizer`` defaults to the
demo model, which is packaged with verl_fast.
"""

import argparse
import random
from pathlib import Path

import torch

from verl_fast.data import RLDataProcessor


def local_pairs(size: int, seed: int = 0):
    """``size`` rows with prompt/chosen/rejected, drawn from ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        wrong = a + b + rng.choice([-10, -2, -1, 1, 2, 10])
        rows.append({"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}. The answer is {a + b}.",
                     "rejected": f"The answer is {wrong}."})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default="smollm2-135m-instruct")
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="data/rl_dataset.pt")
    args = p.parse_args(argv)
    processor = RLDataProcessor(tokenizer_name=args.tokenizer, max_prompt_length=512, max_response_length=512)
    rl_dataset = processor.build_dpo_dataset(local_pairs(args.size, args.seed))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(rl_dataset, args.out)
    print(f"{len(rl_dataset)} pairs -> {args.out}")


if __name__ == "__main__":
    main()
