"""Resharding benchmark, Qwen2.5-7B shapes, bf16, random weights.

(a) one device: HF layout -> vLLM layout (fused qkv_proj / gate_up_proj, TP=1) into preallocated
    tensors with vLLM's names and shapes. Baseline: per-parameter cat + copy. Floor: bytes read +
    written at the copy bandwidth measured in the same run.
    Also the one-shot public call ``vllm_weights(state_dict, spec, device, reuse=True)`` (plans and
    outputs reused between calls, as a sync loop asks for) and its default (new outputs every call,
    the plan reused) against per-parameter ``torch.cat`` allocating its outputs; and that call's
    host work alone (``--only host``: 7B's 339 tensor names, tiny tensors).
(b) two devices (spawned when two are visible, or two gloo processes on the CPU): FSDP2 shards
    (Shard(0) over 2 ranks) -> vLLM TP=2. Baseline: per-parameter all-gather, then the TP slice
    copied in (what vLLM's weight loaders do). Floor: the bytes a rank must receive, at the
    point-to-point bandwidth measured in the same run.
(c) weight sync as the trainer runs it: an FSDP2-sharded module (``fully_shard`` per decoder layer,
    2 ranks) -> vLLM TP=2 parameter tensors, timed around ``WeightSync.run`` (the body of the vLLM
    engine's ``sync_from`` on GPU builds: plan built once, direct writes). Same baseline and floor
    as (b); the seeds' claim for the train/rollout switch printed beside.

    python benchmarks/bench_reshard.py --device cuda             # Qwen2.5-7B on one or two H200s
    python benchmarks/bench_reshard.py --device cpu --scale small
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Report, copy_bandwidth_gbs, sync, time_ms  # noqa: E402

from verl_fast.bench.shapes import shape  # noqa: E402
from verl_fast.ops.reshard import (ModelSpec, fsdp2_layout, hf_layout, logical_shapes, plan,  # noqa: E402
                                   vllm_layout, vllm_weights)
from verl_fast.ops.reshard.layout import local_tensor  # noqa: E402
from verl_fast.ops.reshard.spec import as_2d  # noqa: E402

SEEDS_CLAIM = "train/rollout switch 2.3 s -> 87 ms on 8xA100 (the seeds' claim, not measured here)"

_7B = shape("Qwen2.5-7B")  # 28 layers, hidden 3584, 28 heads / 4 kv heads of 128, MLP 18944, vocab 152064
SCALES = {
    "full": {k: getattr(_7B, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                          "intermediate_size", "vocab_size")},
    "small": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=768,
                  vocab_size=4096),
    # 7B's tensor names and count (28 layers, 339 tensors) in ~0.5 MiB: the one-shot call's host
    # work, with a copy too small to matter
    "names": dict(hidden_size=32, num_layers=_7B.num_layers, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=64, vocab_size=256),
}


def make_spec(scale: str) -> ModelSpec:
    return ModelSpec(family="qwen2", qkv_bias=True, dtype=torch.bfloat16, **SCALES[scale])


def region(t: torch.Tensor, p) -> torch.Tensor:
    """The [nrows, ncols] view of a piece inside physical tensor ``t``."""
    return torch.as_strided(t, (p.nrows, p.ncols), (p.pitch, 1), t.storage_offset() + p.offset)


def logical_view(full: torch.Tensor, p) -> torch.Tensor:
    rows, cols = as_2d(tuple(full.shape))
    return full.reshape(rows, cols)[p.row0:p.row0 + p.nrows, p.col0:p.col0 + p.ncols]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---- (a) one device --------------------------------------------------------------------------


def baseline_cat_copy(dst_tensors, dst: List[torch.Tensor], src: Dict[str, torch.Tensor]) -> None:
    """Per vLLM parameter: cat the HF pieces (zeros for padding), then copy into the parameter."""
    for t, out in zip(dst_tensors, dst):
        parts = [logical_view(src[p.logical], p) if p.logical else out.new_zeros(p.nrows, p.ncols) for p in t.pieces]
        out.copy_((torch.cat(parts) if len(parts) > 1 else parts[0]).reshape(out.shape))


def baseline_cat_alloc(dst_tensors, src: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    """Per vLLM parameter: cat the HF pieces (zeros for padding) into a new tensor."""
    out = []
    for t in dst_tensors:
        parts = [logical_view(src[p.logical], p) if p.logical else src[t.pieces[0].logical].new_zeros(p.nrows, p.ncols)
                 for p in t.pieces]
        out.append((torch.cat(parts) if len(parts) > 1 else parts[0].clone()).reshape(t.shape))
    return out


def bench_one_device(device: str, spec: ModelSpec, tiles_kb: List[int]) -> Report:
    rep = Report("reshard_1dev", device)
    case = "hf->vllm tp1"
    src_layout, dst_layout = hf_layout(spec), vllm_layout(spec, 1)
    g = torch.Generator(device=device).manual_seed(0)
    src = {t.name: torch.randn(t.shape, generator=g, device=device).to(torch.bfloat16) for t in src_layout.tensors}
    dst_tensors = dst_layout.tensors
    base_out = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in dst_tensors]
    moved = nbytes(base_out)
    bw = copy_bandwidth_gbs(device)
    rep.floors[case] = 2 * moved / (bw * 1e9) * 1e3
    ms = time_ms(lambda: baseline_cat_copy(dst_tensors, base_out, src), device)
    rep.add(case, "per-param cat + copy", ms, note=f"{2 * moved / ms / 1e6:.0f} GB/s read+written")
    src_list = [src[t.name] for t in src_layout.tensors]
    ours = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in dst_tensors]
    for kb in tiles_kb:
        p = plan(src_layout, dst_layout, tile_bytes=kb << 10)
        ms = time_ms(lambda: p.execute(src_list, ours), device)
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, base_out))
        rep.add(case, f"verl_fast (tile {kb} KiB)", ms, max_err=err,
                note=f"{2 * moved / ms / 1e6:.0f} GB/s read+written, {p.num_buckets} launch, {p.stats()['tiles']} tiles")
    case = "hf->vllm one-shot call"
    rep.floors[case] = rep.floors["hf->vllm tp1"]
    ms = time_ms(lambda: baseline_cat_alloc(dst_tensors, src), device)
    rep.add(case, "per-param torch.cat (alloc)", ms)
    got = dict(vllm_weights(src, spec, device=device, reuse=True))
    err = max((got[t.name].float() - b.float()).abs().max().item() for t, b in zip(dst_tensors, base_out))
    ms = time_ms(lambda: dict(vllm_weights(src, spec, device=device, reuse=True)), device)
    rep.add(case, "verl_fast vllm_weights", ms, max_err=err, note="reuse=True, the same state dict every call "
                                                                  "(short path)")
    ms = time_ms(lambda: dict(vllm_weights(dict(src), spec, device=device, reuse=True)), device)
    rep.add(case, "vllm_weights, new dict", ms, note="reuse=True, a new dict of the same tensors every call")
    ms = time_ms(lambda: dict(vllm_weights({k: v.detach() for k, v in src.items()}, spec, device=device,
                                           reuse=True)), device)
    rep.add(case, "vllm_weights, new tensors", ms, note="reuse=True, new tensor objects every call, as state_dict() "
                                                        "gives")
    ms = time_ms(lambda: dict(vllm_weights(src, spec, device=device)), device)
    rep.add(case, "vllm_weights, new outputs", ms, note="the default: outputs allocated every call, no later call "
                                                        "writes them")
    for kb in tiles_kb:  # the executor's tile size, as in (a): the copy kernel's share of the call
        ms = time_ms(lambda: dict(vllm_weights(src, spec, device=device, tile_bytes=kb << 10, reuse=True)), device)
        rep.add(case, f"vllm_weights, tile {kb} KiB", ms)
    rep.meta.update(bytes_moved=moved, copy_bandwidth_gbs=bw, spec=str(spec))
    return rep


def bench_host(device: str) -> Report:
    """The one-shot call's own cost: 7B's 339 tensor names in ~0.5 MiB, so that what is timed is the
    host's work around a negligible copy (on a GPU: the time the GPU waits for the launch)."""
    spec = make_spec("names")
    rep = Report("reshard_host", device)
    src_layout, dst_tensors = hf_layout(spec), vllm_layout(spec, 1).tensors
    g = torch.Generator(device=device).manual_seed(0)
    src = {t.name: torch.randn(t.shape, generator=g, device=device).to(torch.bfloat16) for t in src_layout.tensors}
    case = f"one-shot call, {len(src)} tensors"
    rep.add(case, "per-param torch.cat (alloc)", time_ms(lambda: baseline_cat_alloc(dst_tensors, src), device, rep=50))
    rep.add(case, "verl_fast vllm_weights",
            time_ms(lambda: dict(vllm_weights(src, spec, device=device, reuse=True)), device, rep=50),
            note="reuse=True, the same state dict every call: the short path")
    rep.add(case, "vllm_weights, new dict",
            time_ms(lambda: dict(vllm_weights(dict(src), spec, device=device, reuse=True)), device, rep=50),
            note="reuse=True, the same tensors in a new dict: signature, plan lookup, binding check")
    detached = lambda: {k: v.detach() for k, v in src.items()}  # noqa: E731  (what state_dict() gives)
    rep.add(case, "vllm_weights, new tensors",
            time_ms(lambda: dict(vllm_weights(detached(), spec, device=device, reuse=True)), device, rep=50),
            note="reuse=True, new tensor objects (state_dict()) every call over the same memory; includes "
                 "building the dict")
    rep.add(case, "vllm_weights, new outputs",
            time_ms(lambda: dict(vllm_weights(src, spec, device=device)), device, rep=50),
            note="the default: signature, plan lookup, outputs allocated and bound every call")
    p = plan(src_layout, vllm_layout(spec, 1))
    ours = p.allocate_destinations(device)
    src_list = [src[n] for n in p.src_names]
    rep.add(case, "plan.execute (kept plan)", time_ms(lambda: p.execute(src_list, ours), device, rep=50),
            note="a kept plan into kept outputs")
    rep.meta.update(tensors=len(src), bytes_moved=nbytes(ours.values()), spec=str(spec), scale="names")
    return rep


# ---- (b) two devices -------------------------------------------------------------------------


def gather_full(shard: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    full = shard.new_empty((shard.shape[0] * world,) + tuple(shard.shape[1:]))
    if dist.get_backend() == "nccl":
        dist.all_gather_into_tensor(full, shard)
    else:
        dist.all_gather(list(full.chunk(world)), shard)
    return full


def baseline_allgather_slice(logical, shards, dst_by_logical) -> None:
    """Per HF parameter: all-gather the full tensor, then copy this rank's TP slice into place."""
    world = 2
    for name in logical:
        full = gather_full(shards[name], world)
        for p, out in dst_by_logical.get(name, ()):
            region(out, p).copy_(logical_view(full, p))


def p2p_bandwidth_gbs(device: str, nbytes_: int) -> float:
    """Per-direction bandwidth of simultaneous send/recv between the two ranks."""
    import torch.distributed as dist

    rank = dist.get_rank()
    a = torch.empty(nbytes_, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)

    def exchange():
        ops = [dist.P2POp(dist.isend, a, 1 - rank), dist.P2POp(dist.irecv, b, 1 - rank)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    ms = time_ms(exchange, device, warmup=2, rep=10)
    return nbytes_ / (ms * 1e-3) / 1e9


def init_group(rank: int, world: int, port: int, device_type: str) -> str:
    """This worker's process group (NCCL on GPUs, gloo on CPUs); returns its device."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world)
    return f"cuda:{rank}" if device_type == "cuda" else "cpu"


def two_device_worker(rank: int, world: int, port: int, device_type: str, scale: str, buckets_mb, out) -> None:
    import torch.distributed as dist

    device = init_group(rank, world, port, device_type)
    try:
        spec = make_spec(scale)
        src_layout, dst_layout = fsdp2_layout(spec, world), vllm_layout(spec, 2)
        g = torch.Generator(device=device).manual_seed(rank)
        shards = {t.name: torch.randn(t.shape, generator=g, device=device).to(torch.bfloat16)
                  for t in src_layout.on_rank(rank)}
        mine = dst_layout.on_rank(rank)
        base_out = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in mine]
        by_logical: Dict[str, list] = {}
        for t, o in zip(mine, base_out):
            for p in t.pieces:
                if p.logical is None:
                    region(o, p).zero_()
                else:
                    by_logical.setdefault(p.logical, []).append((p, o))
        res = {}
        dist.barrier()
        res["baseline_ms"] = time_ms(lambda: baseline_allgather_slice(spec_logical(spec), shards, by_logical), device)
        res["bytes_written"] = nbytes(base_out)
        ours = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in mine]
        for mb in buckets_mb:
            p = plan(src_layout, dst_layout, bucket_bytes=mb << 20)
            src_list = [shards[t.name] for t in p.src_tensors]
            dist.barrier()
            ms = time_ms(lambda: p.execute(src_list, ours), device)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, base_out))
            res[f"ours_{mb}"] = (ms, err, p.num_buckets)
            res["received_bytes"] = p.stats()["received_bytes"]
        probe = 1 << 30 if device_type == "cuda" else 16 << 20
        res["p2p_gbs"] = p2p_bandwidth_gbs(device, probe)
        res["copy_gbs"] = copy_bandwidth_gbs(device)
        times = torch.tensor([res["baseline_ms"]] + [res[f"ours_{mb}"][0] for mb in buckets_mb], dtype=torch.float64)
        if device_type == "cuda":
            times = times.to(device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        res["max_ms"] = times.cpu().tolist()
        out[rank] = res
    finally:
        dist.destroy_process_group()


def spec_logical(spec: ModelSpec):
    from verl_fast.ops.reshard import logical_shapes

    return list(logical_shapes(spec))


def bench_two_devices(device_type: str, scale: str, buckets_mb: List[int]) -> Report:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(two_device_worker, args=(2, port, device_type, scale, buckets_mb, out), nprocs=2, join=True)
        res = dict(out)
    r0 = res[0]
    device = "cuda:0" if device_type == "cuda" else "cpu"
    rep = Report("reshard_2dev", device)
    case = "fsdp2(2)->vllm tp2"
    received = max(r["received_bytes"] for r in res.values())
    rep.floors[case] = received / (r0["p2p_gbs"] * 1e9) * 1e3
    written = r0["bytes_written"]
    rep.add(case, "per-param all-gather+slice", r0["max_ms"][0], note=f"{written / r0['max_ms'][0] / 1e6:.0f} GB/s written")
    for i, mb in enumerate(buckets_mb):
        ms = r0["max_ms"][1 + i]
        _, err, nb = r0[f"ours_{mb}"]
        err = max(err, res[1][f"ours_{mb}"][1])
        rep.add(case, f"verl_fast (bucket {mb} MiB)", ms, max_err=err,
                note=f"{written / ms / 1e6:.0f} GB/s written, {received / ms / 1e6:.0f} GB/s received, {nb} buckets")
    rep.meta.update(received_bytes_per_rank=received, p2p_gbs=r0["p2p_gbs"], copy_gbs=r0["copy_gbs"],
                    bytes_written_per_rank=written, spec=str(make_spec(scale)))
    return rep


# ---- (c) weight sync in the trainer: FSDP2 module -> vLLM TP=2 parameters ----------------------


def fsdp2_module(spec: ModelSpec, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A module holding ``spec``'s parameters under their HF names, ``fully_shard`` per decoder
    layer and at the root (as the trainer shards an actor), random values."""
    from torch.distributed.fsdp import fully_shard

    root = torch.nn.Module()
    with torch.device("meta"):
        for name, shape in logical_shapes(spec).items():
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=dtype)))
    for layer in root.model.layers.children():
        fully_shard(layer)
    fully_shard(root)
    root.to_empty(device=device)
    with torch.no_grad():
        for p in root.parameters():
            local_tensor(p).normal_()
    return root


def sync_worker(rank: int, world: int, port: int, device_type: str, scale: str, buckets_mb, out) -> None:
    import torch.distributed as dist

    from verl_fast.rollout.weight_sync import WeightSync

    device = init_group(rank, world, port, device_type)
    try:
        spec = make_spec(scale)
        model = fsdp2_module(spec, device, torch.bfloat16)
        # the engine's parameters: vLLM's TP=2 tensors (fused qkv / gate_up, padded vocab) of this rank
        params = {t.name: torch.empty(t.shape, dtype=t.dtype, device=device)
                  for t in vllm_layout(spec, 2).on_rank(rank)}
        shards = {name: local_tensor(p) for name, p in model.named_parameters()}
        mine = vllm_layout(spec, 2).on_rank(rank)
        by_logical: Dict[str, list] = {}
        base = {t.name: torch.empty(t.shape, dtype=t.dtype, device=device) for t in mine}
        for t in mine:
            for p in t.pieces:
                if p.logical is None:
                    region(base[t.name], p).zero_()
                else:
                    by_logical.setdefault(p.logical, []).append((p, base[t.name]))
        res = {}
        dist.barrier()
        res["baseline_ms"] = time_ms(lambda: baseline_allgather_slice(spec_logical(spec), shards, by_logical), device)
        for mb in buckets_mb:
            sync = WeightSync(spec, 2, {0: 0, 1: 1}, world, torch.bfloat16, direct=True, bucket_bytes=mb << 20)
            dist.barrier()
            ms = time_ms(lambda: sync.run(model, params), device)
            err = max((params[k].float() - base[k].float()).abs().max().item() for k in params)
            res[f"ours_{mb}"] = (ms, err, sync.plan.num_buckets)
            res["received_bytes"] = sync.received_bytes
        res["bytes_written"] = nbytes(params.values())
        probe = 1 << 30 if device_type == "cuda" else 16 << 20
        res["p2p_gbs"] = p2p_bandwidth_gbs(device, probe)
        times = torch.tensor([res["baseline_ms"]] + [res[f"ours_{mb}"][0] for mb in buckets_mb], dtype=torch.float64)
        if device_type == "cuda":
            times = times.to(device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        res["max_ms"] = times.cpu().tolist()
        out[rank] = res
    finally:
        dist.destroy_process_group()


def bench_sync(device_type: str, scale: str, buckets_mb: List[int]) -> Report:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(sync_worker, args=(2, port, device_type, scale, buckets_mb, out), nprocs=2, join=True)
        res = dict(out)
    r0 = res[0]
    rep = Report("weight_sync_2dev", "cuda:0" if device_type == "cuda" else "cpu")
    case = "fsdp2 module->vllm tp2"
    received = max(r["received_bytes"] for r in res.values())
    rep.floors[case] = received / (r0["p2p_gbs"] * 1e9) * 1e3
    rep.add(case, "per-param all-gather+slice", r0["max_ms"][0])
    for i, mb in enumerate(buckets_mb):
        _, err, nb = r0[f"ours_{mb}"]
        rep.add(case, f"verl_fast sync (bucket {mb} MiB)", r0["max_ms"][1 + i],
                max_err=max(err, res[1][f"ours_{mb}"][1]), note=f"{nb} buckets, around WeightSync.run")
    rep.meta.update(received_bytes_per_rank=received, p2p_gbs=r0["p2p_gbs"], seeds_claim=SEEDS_CLAIM,
                    bytes_written_per_rank=r0["bytes_written"], spec=str(make_spec(scale)))
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--scale", default=None, choices=list(SCALES), help="default: full on cuda, small on cpu")
    ap.add_argument("--buckets-mb", default="64,256", help="(b): bucket sizes to time (MiB, comma-separated)")
    ap.add_argument("--tiles-kb", default="256", help="(a): executor tile sizes to time (KiB, comma-separated)")
    ap.add_argument("--only", choices=["1", "host", "2", "sync"], default=None,
                    help="run only (a) one device, its one-shot call's host work (7B names, tiny tensors), "
                         "(b) two devices, or (c) the trainer's weight sync on two")
    args = ap.parse_args()
    scale = args.scale or ("full" if args.device == "cuda" else "small")
    buckets = [int(x) for x in args.buckets_mb.split(",")]
    device = "cuda:0" if args.device == "cuda" else "cpu"
    reports = []
    if args.only in (None, "1"):
        reports.append(bench_one_device(device, make_spec(scale), [int(x) for x in args.tiles_kb.split(",")]))
        sync(device)
    if args.only in (None, "host"):
        reports.append(bench_host(device))
        sync(device)
    two_ok = args.device == "cpu" or torch.cuda.device_count() >= 2
    if args.only in (None, "2"):
        if two_ok:
            reports.append(bench_two_devices(args.device, scale, buckets))
        else:
            print("(b) skipped: needs 2 visible GPUs")
    if args.only in (None, "sync"):
        if two_ok:
            reports.append(bench_sync(args.device, scale, buckets))
        else:
            print("(c) skipped: needs 2 visible GPUs")
    for rep in reports:
        rep.meta.setdefault("scale", scale)
        table = rep.table() + "\n" + "\n".join(f"  {r.impl}: {r.note}" for r in rep.rows if r.note)
        print(table)
        print("  meta: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in rep.meta.items() if k != "spec"))
        path = rep.save()
        print(f"  saved {path}")


if __name__ == "__main__":
    main()
