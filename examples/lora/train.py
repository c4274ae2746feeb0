"""GRPO with a LoRA actor: PEFT adapters on the attention projections train, the base stays frozen.

    python examples/lora/train.py                         # the demo model, reasoning-gym chain_sum
    python examples/lora/train.py --model ./my-hf-folder --steps 200

The actor is an ordinary ``peft`` model handed to ``RLTrainer``; with vLLM rollout only the adapter
is pushed to the engine after each update (``model_path`` is the base model's folder).
"""

import argparse

from peft import LoraConfig, get_peft_model
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
    actor = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    config = {
        "actor": {"lr": 2e-4, "micro_batch_size": 16},  # LoRA takes a larger learning rate than full tuning
        "rollout": {"type": args.rollout, "n": args.samples, "max_new_tokens": args.max_new_tokens},
        "reward_fn": {"type": "reasoning_gym"},
        "algorithm": {"type": "grpo"},
        "trainer": {"total_steps": args.steps, "train_batch_size": 4, "output_dir": args.output_dir,
                    "system_prompt": "Answer with just the number.", "max_prompt_length": 128, "device": "cpu"},
    }
    trainer = vf.RLTrainer(actor_model=actor, tokenizer=tokenizer, config=config, model_path=path)
    return trainer.fit("reasoning_gym:chain_sum", size=args.dataset_size, seed=42, min_terms=2, max_terms=2,
                       min_digits=1, max_digits=1)


if __name__ == "__main__":
    main()
