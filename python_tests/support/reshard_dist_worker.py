"""Workers of test_reshard_distributed.py: two gloo ranks holding FSDP2 / FSDP1 / Megatron shards of a
tiny model reshard it into vLLM's TP layout (compared with the plain reference), and into a real
vLLM-CPU engine (external launcher, TP=2) whose greedy outputs must equal HF generate's."""

import os
import traceback

import torch
import torch.distributed as dist

from reshard_refs import assert_same, ref_megatron, ref_vllm
from tiny_models import tiny_model


# vLLM's CPU attention needs head_dim >= 32: 4 heads of 32, 2 kv heads.
VLLM_MODEL = dict(vocab_size=320, hidden_size=128)


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def received_reference(sd, cfg, tp, t, rank, world):
    """Elements of vLLM's TP shard t that FSDP2 rank ``rank`` does not hold: every logical element gets
    a unique number, the reference conversion moves the numbers, and we count those not held."""
    glob, base = {}, 0
    for k, v in sd.items():
        glob[k] = torch.arange(base + 1, base + v.numel() + 1, dtype=torch.float64).view(v.shape)
        base += v.numel()
    held = set()
    for v in glob.values():
        chunks = v.chunk(world)  # Shard(0): torch.chunk, ranks past the last chunk hold nothing
        if rank < len(chunks):
            held.update(chunks[rank].reshape(-1).long().tolist())
    need = [x for v in ref_vllm(glob, cfg, tp, t).values() for x in v.reshape(-1).long().tolist()]
    return sum(1 for x in need if x and x not in held)  # 0: vocab padding


def fsdp_case(rank, world, port, families, out):
    """FSDP2 (and FSDP1 for dense models) -> vLLM TP=2 and TP=1, against the reference."""
    _init(rank, world, port)
    try:
        for family in families:
            _fsdp_family(rank, world, family)
        out[rank] = "ok"
    except Exception:
        out[rank] = traceback.format_exc()
    finally:
        dist.destroy_process_group()


def _fsdp_family(rank, world, family):
    from verl_fast.ops.reshard import (ModelSpec, fsdp1_layout_from_module, fsdp1_sources, plan, source_layout,
                                      vllm_layout, vllm_weights)

    extra = {"vocab_size": 301} if family == "qwen2" else {}  # 301 rows split 151 / 150, padded to 320
    full = tiny_model(family, **extra)
    sd, cfg = {k: v.clone() for k, v in full.state_dict().items()}, full.config
    model = _fsdp2(tiny_model(family, **extra))
    for tp in (2, 1):
        got = dict(vllm_weights(model, tensor_parallel_size=tp, tp_rank=rank % tp))
        assert_same(got, ref_vllm(sd, cfg, tp, rank % tp))
    got = dict(vllm_weights(model, tensor_parallel_size=2, dtype=torch.bfloat16))
    assert_same(got, {k: v.to(torch.bfloat16) for k, v in ref_vllm(sd, cfg, 2, rank).items()})
    spec = ModelSpec.from_hf_config(cfg)
    state = model.state_dict()
    p = plan(source_layout(spec, state), vllm_layout(spec, 2), bucket_bytes=2048)  # many buckets
    assert p.num_buckets > 3, p.num_buckets
    assert_same(dict(p.execute(state)), ref_vllm(sd, cfg, 2, rank))
    stats = p.stats()
    want = received_reference(sd, cfg, 2, rank, rank, world) * 4
    assert stats["received_bytes"] == want, (stats, want)
    if not spec.is_moe:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        inner = tiny_model(family, **extra)  # one flat parameter per decoder layer, one for the rest
        policy = ModuleWrapPolicy({type(inner.model.layers[0])})
        fsdp1 = FSDP(inner, use_orig_params=False, device_id=torch.device("cpu"), auto_wrap_policy=policy)
        p1 = plan(fsdp1_layout_from_module(spec, fsdp1), vllm_layout(spec, 2))
        assert_same(dict(p1.execute(fsdp1_sources(fsdp1))), ref_vllm(sd, cfg, 2, rank))
    if family == "qwen2":  # DTensors placed every way: Shard(0), Shard(-1) (TP-style), Replicate
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        kinds = [Shard(0), Shard(-1), Replicate()]
        mixed = {k: distribute_tensor(v, mesh, [kinds[i % 3] if v.dim() > 1 or i % 3 != 1 else Shard(0)])
                 for i, (k, v) in enumerate(sd.items())}
        got = dict(vllm_weights(mixed, cfg, tensor_parallel_size=2))
        assert_same(got, ref_vllm(sd, cfg, 2, rank))
    if family == "llama":  # Megatron TP=2 shards in the two processes -> vLLM TP=2 and TP=1
        from verl_fast.ops.reshard.megatron import megatron_layout

        shard = ref_megatron(sd, cfg, 2, 1, 512)[(rank, 0)]
        for tp in (2, 1):
            dst = vllm_layout(spec, tp, {r: r % tp for r in range(2)})
            q = plan(megatron_layout(spec, 2, 1, padded_vocab_size=512), dst)
            assert_same(dict(q.execute(shard)), ref_vllm(sd, cfg, tp, rank % tp))


def vllm_case(rank, world, port, model_dir, out):
    """A real vLLM-CPU engine (TP=2 over the two ranks) reloaded from FSDP2 shards via vllm_weights."""
    _init(rank, world, port)
    try:
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
        from vllm import LLM, SamplingParams

        from verl_fast.ops.reshard import ModelSpec, vllm_names, vllm_weights

        trained = tiny_model("qwen2", seed=0, **VLLM_MODEL)  # the weights to push; the folder holds seed 1
        prompts = [[5, 17, 42, 9], [100, 3, 250, 7, 8, 64]]
        ref = trained.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)[0, 4:].tolist(), \
            trained.generate(torch.tensor([prompts[1]]), max_new_tokens=12, do_sample=False)[0, 6:].tolist()
        model = _fsdp2(tiny_model("qwen2", seed=0, **VLLM_MODEL))
        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0,
                  tensor_parallel_size=2, distributed_executor_backend="external_launcher", skip_tokenizer_init=True)
        names = llm.collective_rpc(lambda self: [n for n, _ in self.model_runner.model.named_parameters()])[0]
        assert sorted(names) == sorted(vllm_names(ModelSpec.from_hf_config(trained.config))), names
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

        def generate():
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return tuple(list(r.outputs[0].token_ids) for r in res)

        before = generate()
        weights = list(vllm_weights(model, tensor_parallel_size=1))  # fused, whole: vLLM slices its TP shard
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        llm.reset_prefix_cache()
        after = generate()
        assert before != ref, "the folder's weights already generate the reference"
        assert after == ref, (after, ref)
        out[rank] = "ok"
    except Exception:
        out[rank] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
