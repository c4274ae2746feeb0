"""The CUDA executor against the CPU executor (bit-exact): every family into vLLM's TP shards, dtype
conversion, random layouts with odd offsets (every vector width of the copy kernel), rows wider than
a tile, rebinding; and FSDP2-style shards on two GPUs over NCCL into vLLM TP=2."""

import random
import socket
import traceback

import pytest
import torch

from verl_fast.ops.reshard import ModelSpec, fsdp2_layout, hf_layout, plan, vllm_layout
from verl_fast.ops.reshard.layout import Layout

from reshard_refs import assert_same, plain_config, random_state, ref_vllm
from test_reshard_planner import cells, materialise, pack

pytestmark = pytest.mark.gpu

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu_and_reference(family, tp, dtype):
    cfg = plain_config(family)
    spec = ModelSpec.from_hf_config(cfg, dtype=torch.float32)
    sd = random_state(spec)
    for t in range(tp):
        p = plan(hf_layout(spec), vllm_layout(spec, tp, {0: t}, dtype=dtype), bucket_bytes=1 << 12, tile_bytes=1 << 12)
        cpu = p.execute(sd)
        gpu = p.execute({k: v.cuda() for k, v in sd.items()})
        for k, v in cpu.items():
            assert gpu[k].device.type == "cuda"
            assert torch.equal(gpu[k].cpu().view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               v.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), k
        assert_same(dict(cpu), {k: v.to(dtype) for k, v in ref_vllm(sd, cfg, tp, t).items()})


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_random_layouts_cuda(seed, dtype):
    """Odd offsets and pitches in 1-, 2- and 4-byte dtypes reach every vector width of the kernel."""
    from collections import OrderedDict

    rng = random.Random(seed)
    logical = OrderedDict((f"w{i}", (rng.randint(1, 40), rng.randint(1, 40))) for i in range(3))
    src = [pack(rng, "a", [(n, *c) for n, s in logical.items() for c in cells(rng, *s)], dtype, False)]
    dst = [pack(rng, "x", [(n, *c) for n, s in logical.items() for c in cells(rng, *s)], dtype, True)]
    p = plan(Layout(logical, src, 1), Layout(logical, dst, 1), tile_bytes=rng.choice([16, 64, 4096]))
    values = {n: torch.randint(0, 100, s).double() for n, s in logical.items()}
    sources = {t.name: materialise(t, values, 0.0).to(t.dtype) for t in src}
    cpu = p.execute(sources)["x"]
    gpu = p.execute({k: v.cuda() for k, v in sources.items()})["x"]
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(cpu, materialise(dst[0], values, 0.0).to(dtype))


def test_wide_rows_and_rebinding():
    cfg = plain_config("qwen2", hidden_size=4096, intermediate_size=64, num_hidden_layers=1, vocab_size=64)
    spec = ModelSpec.from_hf_config(cfg, dtype=torch.float32)
    p = plan(hf_layout(spec), vllm_layout(spec, 2, {0: 1}), tile_bytes=1024)  # rows of 16 KiB: column tiles
    for seed in range(2):  # new source and destination tensors: the pointer table is uploaded again
        sd = random_state(spec, device="cuda", seed=seed)
        out = p.execute(sd, p.allocate_destinations("cuda"))
        assert_same({k: v.cpu() for k, v in out.items()},
                    ref_vllm({k: v.cpu() for k, v in sd.items()}, cfg, 2, 1))


def _nccl_worker(rank, world, port, out):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        for family in ("qwen2", "qwen3_moe"):
            cfg = plain_config(family)
            spec = ModelSpec.from_hf_config(cfg, dtype=torch.float32)
            full = random_state(spec)
            shards = {k: v.chunk(world)[rank].contiguous().cuda() for k, v in full.items()}
            for dtype in (torch.float32, torch.bfloat16):
                p = plan(fsdp2_layout(spec, world), vllm_layout(spec, 2, dtype=dtype), bucket_bytes=4096)
                assert p.num_buckets > 3
                for _ in range(2):
                    got = {k: v.cpu() for k, v in p.execute(shards).items()}
                    assert_same(got, {k: v.to(dtype) for k, v in ref_vllm(full, cfg, 2, rank).items()})
        out[rank] = "ok"
    except Exception:
        out[rank] = traceback.format_exc()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_to_vllm_tp2_over_nccl():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_nccl_worker, args=(2, port, out), nprocs=2, join=True)
        results = dict(out)
    for rank in range(2):
        assert results.get(rank) == "ok", f"rank {rank}:\n{results.get(rank)}"
