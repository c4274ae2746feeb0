"""One rank of test_hybrid_engine.py: an FSDP2 or FSDP1 actor trained with GRPO while every rank runs its
own in-process vLLM engine (external launcher when WORLD > 1, TP groups of ``tp`` consecutive ranks):
gloo and vLLM-CPU on the CPU, NCCL and one GPU per rank (bf16 engine, eager) on GPUs. After training
each rank's engine must decode greedily what the trained actor decodes through HF (``engine_ok``,
rollout_refs.EngineReference), and each rank must have received exactly the bytes of its TP shard
that it did not hold.

    python hybrid_worker.py RANK WORLD PORT MODEL_DIR OUT_DIR TP [fsdp2|fsdp1|fsdp1_orig]
"""

import json
import os
import sys

import torch
import torch.distributed as dist

PROMPTS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4)]]


def greedy_hf(model, prompts, tokens):
    out = []
    for ids in prompts:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        out.append(seq[0, len(ids):].tolist())
    return out


def grpo_config(out_dir: str, tp: int, **actor):
    """3 GRPO steps with vLLM rollout at TP ``tp``; ``actor``: more actor settings."""
    from rollout_refs import ENGINE_DTYPE

    return {"actor": {"lr": 2e-2, "micro_batch_size": 16, **actor},
            "rollout": {"type": "auto", "n": 4, "max_new_tokens": 4, "dtype": ENGINE_DTYPE, "max_model_len": 96,
                        "max_num_seqs": 16, "tensor_parallel_size": tp, "enforce_eager": True},
            "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
            "trainer": {"total_steps": 3, "train_batch_size": 4, "output_dir": out_dir, "progress_bar": False,
                        "plot": False, "save_freq": 0, "max_prompt_length": 64}}


def init_process(rank: int, world: int, port: int) -> torch.device:
    """The environment, vLLM's in-process settings and torch.distributed for one rank; its device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), VLLM_CPU_KVCACHE_SPACE="1")
    from verl_fast.rollout.vllm_env import configure_vllm_env

    configure_vllm_env()
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


def wrapped(model, wrap: str, device: torch.device):
    """``model`` sharded over the world as a user would wrap it: FSDP2 per decoder layer, or FSDP1
    (flat parameters; ``fsdp1_orig``: ``use_orig_params=True``)."""
    model = model.to(device)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(model, use_orig_params=wrap == "fsdp1_orig", device_id=device,
                auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}))


def full_state(model, wrap: str):
    """The whole model's weights on every rank (collective), by HF name."""
    if wrap == "fsdp2":
        return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return {k.replace("_fsdp_wrapped_module.", ""): v.detach().cpu().clone()
                for k, v in model.module.state_dict().items()}


def engine_decodes(engine, model, prompts, tokens=6):
    """What ``engine`` decodes greedily, and whether that is what ``model`` decodes (EngineReference)."""
    from rollout_refs import EngineReference
    from verl_fast.records.generation import SamplingSpec

    out = engine.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=tokens))
    decoded = [out.response_ids[i][: int(out.response_mask[i].sum())].tolist() for i in range(len(prompts))]
    ref = EngineReference(model)
    try:
        for ids, toks in zip(prompts, decoded):
            ref.assert_greedy(toks, ids, tokens)
    except AssertionError as e:
        return decoded, f"{e}"
    return decoded, "ok"


def main(rank: int, world: int, port: int, model_dir: str, out_dir: str, tp: int, wrap: str = "fsdp2") -> None:
    device = init_process(rank, world, port)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reshard_dist_worker import received_reference
    from verl_fast.trainer.rl_trainer import RLTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = wrapped(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), wrap, device)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=grpo_config(out_dir, tp), model_path=None,
                        reward_fn=lambda solution_str: float(len(solution_str) % 2))
    history = trainer.fit(PROMPTS)
    moved = trainer.engine.sync_from(model)["bytes"]  # what one sync moves into this rank
    trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trained.load_state_dict(full_state(model, wrap))
    trained.eval()
    rows = trainer.processor.encode_all(PROMPTS)
    prompts = [r.prompt_ids for r in rows]
    # this rank's own engine (its TP group decodes the same prompts together)
    engine = trainer.engine.engine if hasattr(trainer.engine, "engine") else trainer.engine
    decoded, ok = engine_decodes(engine, trained, prompts)
    # the bytes of this rank's TP shard its FSDP2 shard lacks (FSDP1's flat shards cut elsewhere: not counted)
    minimum = received_reference(initial.state_dict(), initial.config, tp, rank % tp, rank, world) * \
        engine.dtype.itemsize if wrap == "fsdp2" else None
    result = {"history": history, "engine": decoded, "engine_ok": ok, "trained": greedy_hf(trained, prompts, 6),
              "initial": greedy_hf(initial, prompts, 6), "bytes": moved, "minimum": minimum,
              "engine_type": type(engine).__name__}
    finish(rank, out_dir, result, engine)


def finish(rank: int, out_dir: str, result: dict, engine) -> None:
    """Writes this rank's result for the test, then closes the engine once every rank is done."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    engine.close()  # vLLM's shutdown also tears down the default process group


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]),
         *sys.argv[7:])
