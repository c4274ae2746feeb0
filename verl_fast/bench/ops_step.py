"""An end-to-end GRPO step on the user's device: a tiny random-weight model and a character-level
tokenizer built here (nothing downloaded), the trainer's defaults, the HF engine for the rollout.

    python -m verl_fast.bench.ops_step [--device cpu|cuda] [--quick]

Rows, one case each: the whole step, its generation and its actor update (the median of the steps
after the first, which compiles and warms the caches). The reward is random: a random-weight model
answers nothing, and the step's work does not depend on what the reward says.
"""

from __future__ import annotations

import argparse
import random
import string
import tempfile
from typing import Any, Dict, List

import torch

from verl_fast.bench.record import Ms, Report
from verl_fast.bench.timing import summarize

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# (hidden, layers, heads, kv heads, intermediate); head_dim 32 or 64, which every attention path takes
SHAPES = {"tiny": (64, 2, 2, 1, 128), "small": (256, 4, 4, 2, 768)}
SIZES = {True: dict(shape="tiny", prompts=4, n=4, tokens=16, steps=3),
         False: dict(shape="small", prompts=8, n=8, tokens=64, steps=5)}


def char_tokenizer():
    """One token per printable ASCII character, the ChatML markers, EOS = pad = <|endoftext|>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + sorted(set(string.printable)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL[0], pad_token=SPECIAL[0])
    fast.chat_template = CHATML
    return fast


def random_model(shape: str, vocab_size: int, eos: int, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, heads, kv, inter = SHAPES[shape]
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(device)


def prompts(count: int, seed: int = 0) -> List[Dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": f"What is {rng.randint(0, 99)} + {rng.randint(0, 99)}?"}],
             "reward_model": {"ground_truth": "0"}, "data_source": "bench"} for _ in range(count)]


def run(device: str, quick: bool) -> Report:
    from verl_fast.trainer.rl_trainer import RLTrainer

    size = SIZES[quick]
    tokenizer = char_tokenizer()
    model = random_model(size["shape"], len(tokenizer), tokenizer.eos_token_id, device)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="vf_bench_step_") as out:
        cfg = {"rollout": {"type": "hf", "n": size["n"], "max_new_tokens": size["tokens"], "temperature": 1.0},
               "algorithm": {"type": "grpo"},
               "trainer": {"train_batch_size": size["prompts"], "total_steps": size["steps"], "device": device,
                           "output_dir": out, "progress_bar": False, "plot": False}}
        trainer = RLTrainer(actor_model=model, tokenizer=tokenizer, config=cfg,
                            reward_fn=lambda solution_str, ground_truth: rng.random())
        rows = trainer.processor.encode_all(prompts(size["prompts"] * size["steps"]))
        steps = [trainer.train_step(rows[s * size["prompts"]:(s + 1) * size["prompts"]]) for s in range(size["steps"])]
    report = Report("step", device)
    report.meta.update(size, params=sum(p.numel() for p in model.parameters()), warmup_steps=1)
    label = f"grpo {size['shape']} model, {size['prompts']} prompts x {size['n']}, {size['tokens']} new tokens"
    for case, key in (("step", "time/step"), ("generation", "time/generation"), ("actor update", "time/update_actor")):
        times = [m[key] * 1e3 for m in steps[1:] if key in m]
        if times:
            stats = summarize(times)
            ms = Ms(stats.median_ms)
            ms.stats = stats
            report.add(f"{label}: {case}", "verl_fast", ms)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="a 2-layer model, 4 prompts x 4 samples x 16 tokens, 3 steps")
    args = p.parse_args(argv)
    report = run(args.device, args.quick)
    path = report.save()
    print(report.table())
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
