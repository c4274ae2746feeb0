"""compute_gae and the GRPO advantage against the implementations peers use, with the memory floor.

    python -m verl_fast.bench.ops_advantage [--device cpu|cuda] [--quick]

Baselines (written here the way verl writes them):
- GAE: a reverse Python loop over T, vectorised over the batch, then masked whitening.
- GRPO: a Python dict grouping scores by uid, then a per-sample loop.
Floor: bytes that must move (inputs read once, outputs written once) / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from verl_fast.bench.record import Report, copy_bandwidth_gbs, time_ms

import verl_fast as vf

GAE_SIZES = [(256, 1024), (1024, 4096), (4096, 8192)]


def loop_gae(rewards, values, mask, gamma, lam):
    """The reverse loop over T that verl and most peers use (vectorised over the batch)."""
    mask = mask.float()
    next_values = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        cand = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = cand * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    returns = adv + values
    n = mask.sum()
    mean = (adv * mask).sum() / n
    var = (((adv - mean) ** 2) * mask).sum() / n * (n / (n - 1))
    return (adv - mean) * torch.rsqrt(var + 1e-8), returns


def dict_grpo(rewards, mask, index, eps=1e-6):
    """verl-style GRPO: Python dict of scores per uid, then a loop over samples."""
    scores = rewards.sum(-1)
    groups = defaultdict(list)
    for i in range(scores.shape[0]):
        groups[index[i]].append(scores[i])
    mean, std = {}, {}
    for g, xs in groups.items():
        if len(xs) == 1:
            mean[g], std[g] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            t = torch.stack(xs)
            mean[g], std[g] = t.mean(), t.std()
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + eps)
    return scores.unsqueeze(-1) * mask


def graph_ms(fn, device: str) -> float:
    """Median time of replaying ``fn`` captured in a CUDA graph: the GPU work without Python."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, device, warmup=3, rep=50)


def gae_inputs(B, T, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = torch.randn(B, T, generator=g).to(device)
    v = torch.randn(B, T, generator=g).to(device)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    m = (torch.arange(T)[None, :] < lengths[:, None]).to(device)
    return r, v, m


def bench_gae(report: Report, device: str, bandwidth: float, sizes) -> None:
    for B, T in sizes:
        case = f"gae {B}x{T}"
        r, v, m = gae_inputs(B, T, device)
        ours = lambda: vf.compute_gae(r, v, m, 0.99, 0.95)  # noqa: E731
        adv, ret = ours()
        ref_adv, ref_ret = loop_gae(r, v, m, 0.99, 0.95)
        err = max((adv - ref_adv).abs().max().item(), (ret - ref_ret).abs().max().item())
        report.add(case, "verl_fast", time_ms(ours, device, warmup=3, rep=20), max_err=err)
        if device.startswith("cuda"):
            nosync = lambda: vf.compute_gae(r, v, m, 0.99, 0.95, check=False)  # noqa: E731
            report.add(case, "verl_fast check=False", time_ms(nosync, device, warmup=3, rep=50), max_err=err,
                       note="no status read-back (no host sync)")
            report.add(case, "verl_fast graph replay", graph_ms(nosync, device), max_err=err,
                       note="GPU time alone: the call captured in a CUDA graph, replayed")
        base_rep = 2 if B * T > 4_000_000 else 5
        report.add(case, "python loop (verl)", time_ms(lambda: loop_gae(r, v, m, 0.99, 0.95), device,
                                                       warmup=1, rep=base_rep, max_seconds=60))
        nbytes = B * T * (4 + 4 + 1 + 4 + 4)  # rewards, values, mask in; advantages, returns out
        report.floors[case] = nbytes / (bandwidth * 1e9) * 1e3


def bench_grpo(report: Report, device: str, bandwidth: float, n: int, group: int, T: int) -> None:
    case = f"grpo {n} in groups of {group}, T={T}"
    g = torch.Generator().manual_seed(1)
    r = torch.zeros(n, T)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    r[torch.arange(n), lengths - 1] = (torch.rand(n, generator=g) < 0.5).float()
    r = r.to(device)
    m = (torch.arange(T)[None, :] < lengths[:, None]).to(device)
    uids = [f"uid-{i // group}" for i in range(n)]
    ours = lambda: vf.compute_grpo_advantage(r, m, uids)  # noqa: E731
    adv, _ = ours()
    ref = dict_grpo(r.clone(), m, uids)
    report.add(case, "verl_fast", time_ms(ours, device, warmup=2, rep=10),
               max_err=(adv - ref).abs().max().item())
    report.add(case, "python dict (verl)", time_ms(lambda: dict_grpo(r.clone(), m, uids), device,
                                                   warmup=1, rep=2, max_seconds=60))
    report.floors[case] = n * T * (4 + 1 + 4) / (bandwidth * 1e9) * 1e3


def profile_gae(device: str, B: int = 1024, T: int = 4096) -> str:
    """GPU time per kernel of one compute_gae call (torch.profiler), to place the time."""
    from torch.profiler import ProfilerActivity, profile

    r, v, m = gae_inputs(B, T, device)
    for _ in range(3):
        vf.compute_gae(r, v, m, 0.99, 0.95)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            vf.compute_gae(r, v, m, 0.99, 0.95)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)


def run(device: str, quick: bool = False) -> Report:
    report = Report("advantage", device)
    bandwidth = copy_bandwidth_gbs(device)
    report.meta["copy_bandwidth_GBps"] = bandwidth
    report.meta["gamma_lam"] = [0.99, 0.95]
    sizes = GAE_SIZES[:1] if quick else GAE_SIZES
    bench_gae(report, device, bandwidth, sizes)
    bench_grpo(report, device, bandwidth, 4096 if quick else 65536, 16, 256 if quick else 512)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="smallest sizes only")
    args = p.parse_args(argv)
    report = run(args.device, args.quick)
    if args.device.startswith("cuda"):
        print(profile_gae(args.device))
    path = report.save()
    print(report.table())
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
