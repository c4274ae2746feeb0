"""GRPO on a vision-language model: "how many red squares?" on synthetic pictures, on the CPU.

    python examples/vlm_grpo/train.py                     # a tiny random-weight Qwen2-VL, ~3 minutes
    python examples/vlm_grpo/train.py --model ./my-qwen2-vl-folder --steps 200

The prompts are verl-format rows (an ``images`` column of PNG bytes, an ``<image>`` placeholder in the
text). The reward reads the picture itself (TRL's contract fills ``images`` by name): it counts the
red cells of the picture's 3 x 3 grid and scores the completion's first number 1 / (1 + its distance
from that count). Without ``--model`` the actor is a random-weight Qwen2-VL built here with a locally
trained tokenizer (``verl_fast.models.random_vlm``): the reward rises as it learns to answer with a
number, then a small one. The vision tower stays frozen (``actor.freeze_vision_tower``).
"""

import argparse
import io
import random
import re

import verl_fast as vf
from verl_fast.models import random_vlm

GRID = 3  # squares sit on distinct cells of a GRID x GRID grid, so the reward can count them back
RED = (220, 20, 20)


def draw_squares(count: int, size: int = 56, seed: int = 0):
    """An RGB picture with ``count`` red squares on distinct cells of the grid, on white."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    cell = size // GRID
    for k in rng.sample(range(GRID * GRID), count):
        x, y = (k % GRID) * cell, (k // GRID) * cell
        draw.rectangle([x + 2, y + 2, x + cell - 3, y + cell - 3], fill=RED)
    return image


def red_cells(image) -> int:
    """How many grid cells of ``image`` are red at their centre."""
    cell = image.width // GRID
    return sum(image.getpixel(((k % GRID) * cell + cell // 2, (k // GRID) * cell + cell // 2)) == RED
               for k in range(GRID * GRID))


def rows(count: int, seed: int = 0) -> list:
    """verl-format rows: the picture as PNG bytes in ``images``, ``<image>`` in the prompt."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randint(1, 3)
        png = io.BytesIO()
        draw_squares(n, seed=seed * 100_003 + i).save(png, format="PNG")
        out.append({"data_source": "red_squares", "images": [{"bytes": png.getvalue()}],
                    "prompt": [{"role": "user", "content": "<image>How many red squares are in the image?"}],
                    "reward_model": {"ground_truth": str(n)}})
    return out


def count_reward(completions, images, **kwargs):
    """1 / (1 + |first number of the completion - the picture's count of red squares|), 0 without a number."""
    scores = []
    for completion, pictures in zip(completions, images):
        text = completion[0]["content"] if isinstance(completion, list) else completion  # chat prompts: messages
        found = re.search(r"\d+", text)
        scores.append(0.0 if found is None else 1.0 / (1 + abs(int(found.group()) - red_cells(pictures[0]))))
    return scores


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Qwen2-VL / Qwen2.5-VL folder (default: a tiny random one)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--samples", type=int, default=8, help="responses per prompt")
    p.add_argument("--max_new_tokens", type=int, default=4)
    p.add_argument("--output_dir", default="runs/examples/vlm_grpo")
    p.add_argument("--dataset_size", type=int, default=64)
    args = p.parse_args(argv)
    actor, processor = (args.model, None) if args.model else random_vlm.build("qwen2_vl", "tiny", seed=0)
    config = {
        "actor": {"lr": 5e-3, "micro_batch_size": 32},
        "rollout": {"type": "hf", "n": args.samples, "max_new_tokens": args.max_new_tokens, "temperature": 1.0},
        "algorithm": {"type": "grpo"},
        "trainer": {"total_steps": args.steps, "train_batch_size": 4, "output_dir": args.output_dir,
                    "max_prompt_length": 128, "device": "cpu", "plot": False, "overwrite": True},
    }
    trainer = vf.RLTrainer(actor_model=actor, tokenizer=processor, reward_fn=count_reward, config=config)
    return trainer.fit(rows(args.dataset_size))


if __name__ == "__main__":
    main()
