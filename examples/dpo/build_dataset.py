"""Seed 002's data step: webgpt_comparisons -> preference pairs -> data/rl_dataset.pt.

    python examples/dpo/build_dataset.py --tokenizer meta-llama/Llama-2-7b-chat-hf
    verl-fast train --config examples/dpo/config.yaml --dataset_path ./data/rl_dataset.pt

``--source``: a Hugging Face dataset name (needs the hub) or a local parquet / jsonl / datasets folder
with webgpt's fields (question, answer_1, answer_2, score_1, score_2) or prompt/chosen/rejected.
"""

import argparse
from pathlib import Path

import torch

from verl_fast.data import RLDataProcessor


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default="meta-llama/Llama-2-7b-chat-hf")
    p.add_argument("--source", default="openai/webgpt_comparisons")
    p.add_argument("--out", default="data/rl_dataset.pt")
    args = p.parse_args(argv)
    if Path(args.source).exists():
        dataset = args.source
    else:
        from datasets import load_dataset

        dataset = load_dataset(args.source, split="train[:1000]")
    processor = RLDataProcessor(tokenizer_name=args.tokenizer, max_prompt_length=512, max_response_length=512)
    rl_dataset = processor.build_dpo_dataset(dataset)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(rl_dataset, args.out)
    print(f"{len(rl_dataset)} pairs -> {args.out}")


if __name__ == "__main__":
    main()
