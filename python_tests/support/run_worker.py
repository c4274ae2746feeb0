"""A short single-process training run for the fault tests (kill -9, SIGTERM):
``python run_worker.py MODEL_DIR OUT_DIR TOTAL_STEPS SAVE_FREQ MODE``.

MODE ``hang_in_write``: the checkpoint of step 2 stops after its shards are written (before the
manifest) and ``OUT_DIR/writing`` appears, so the test can kill the process mid-write.
MODE ``slow``: each step's reward touches ``OUT_DIR/in_step_<k>`` and sleeps 1 s, a window for signals.
MODE ``plain``: just the run. The history goes to ``OUT_DIR/history.json``."""

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.trainer.rl_trainer import RLTrainer


def main(model_dir: str, out_dir: str, total: int, save_freq: int, mode: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    calls = {"n": 0}

    def reward(solution_str):
        calls["n"] += 1
        if mode == "slow" and calls["n"] % 8 == 1:  # 2 prompts x 4 samples: the first sample of a step
            (out / f"in_step_{calls['n'] // 8 + 1}").touch()
            time.sleep(1.0)
        return float(len(solution_str) % 2)

    if mode == "hang_in_write":
        write = checkpoint._write_metadata

        def hanging(tmp, step, *args, **kwargs):
            if step == 2:
                (out / "writing").touch()
                time.sleep(600)
            return write(tmp, step, *args, **kwargs)

        checkpoint._write_metadata = hanging
    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": total, "save_freq": save_freq, "train_batch_size": 2,
                       "output_dir": str(out / "run"), "progress_bar": False, "plot": False, "device": "cpu"}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg)
    prompts = [{"prompt": f"What is {a} + {b}?"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    history = trainer.fit(prompts)
    (out / "history.json").write_text(json.dumps({"steps": [h["step"] for h in history],
                                                  "stopped": trainer.stopped}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
