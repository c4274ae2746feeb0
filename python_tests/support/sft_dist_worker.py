"""One rank of the 2-process FSDP2 (gloo) SFT test: ``python sft_dist_worker.py RANK WORLD PORT MODEL_DIR
OUT_DIR`` trains ``sft_rows()`` for 2 steps (the test runs the same in one process)."""

import json
import os
import sys

import torch
import torch.distributed as dist


def sft_rows():
    return [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                          {"role": "assistant", "content": f"{2 * i}" + " indeed" * (i % 4)}]} for i in range(8)]


def config(out_dir: str, strategy: str) -> dict:
    return {"actor": {"lr": 1e-2, "strategy": strategy, "micro_batch_size": 2}, "algorithm": {"type": "sft"},
            "trainer": {"total_steps": 2, "train_batch_size": 4, "output_dir": out_dir, "progress_bar": False,
                        "plot": False, "device": "cpu"}}


def main(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.trainer.rl_trainer import RLTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=config(out_dir, "fsdp2"))
    history = trainer.fit(sft_rows(), val_dataset=sft_rows()[:3])  # 2 rows on rank 0, 1 on rank 1
    if rank == 0:
        json.dump(history, open(os.path.join(out_dir, "rank0.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
