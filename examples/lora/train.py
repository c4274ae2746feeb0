"""GRPO with a LoRA actor: PEFT adapters on the attention projections train, the base stays frozen.

    python examples/lora/train.py                         # the demo model, reasoning-gym chain_sum
    python examples/lora/train.py --model ./my-hf-folder --steps 200

``actor.lora`` in the config wraps the actor in peft adapters (the same key works in YAML with
``verl-fast train``); with vLLM rollout only the adapter is pushed to the engine after each update
(``model_path`` is the base model's folder). The final checkpoint's HF export is the merged model,
with peft's adapter folder in ``adapter/``.
"""

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer

import verl_fast as vf
from verl_fast.models.loading import resolve


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="local HF folder or the demo model's name")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--samples", type=int, default=8, help="responses per prompt")
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--rollout", default="auto", choices=("auto", "hf", "vllm"))
    p.add_argument("--output_dir", default="runs/examples/lora")
    p.add_argument("--dataset_size", type=int, default=1000)
    args = p.parse_args(argv)
    path = resolve(args.model)
    base = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = {
        # LoRA takes a larger learning rate than full tuning
        "actor": {"lr": 2e-4, "micro_batch_size": 16,
                  "lora": {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
        "rollout": {"type": args.rollout, "n": args.samples, "max_new_tokens": args.max_new_tokens},
        "reward_fn": {"type": "reasoning_gym"},
        "algorithm": {"type": "grpo"},
        "trainer": {"total_steps": args.steps, "train_batch_size": 4, "output_dir": args.output_dir,
                    "system_prompt": "Answer with just the number.", "max_prompt_length": 128, "device": "cpu"},
    }
    trainer = vf.RLTrainer(actor_model=base, tokenizer=tokenizer, config=config, model_path=path)
    return trainer.fit("reasoning_gym:chain_sum", size=args.dataset_size, seed=42, min_terms=2, max_terms=2,
                       min_digits=1, max_digits=1)


if __name__ == "__main__":
    main()
