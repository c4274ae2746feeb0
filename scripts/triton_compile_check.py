"""Compiles the Triton kernels (log-probs, decode attention) for a GPU architecture on a machine without a GPU, and prints
each kernel's registers, spills and shared memory.

The interpreter (TRITON_INTERPRET=1) checks the numerics on CPU but never compiles; this catches
compile errors and shows what a block-size choice costs, before any GPU time is spent. It swaps in a
stand-in Triton driver that only reports a target, then calls each kernel's ``warmup`` (compile, no
launch) with the default block sizes for that architecture.

    python scripts/triton_compile_check.py [--arch 90]      (run without TRITON_INTERPRET)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget


class _TargetOnlyDriver:
    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


def _ptxas_info(ptx: str, arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        run = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores", run.stderr)
    return f"{regs.group(1) if regs else '?'} regs, {spills.group(1) if spills else '?'} B spilled"


def _variants(device: torch.device):
    """(name, kernel, args, constexprs + launch options) for the kernels and flag combinations we ship."""
    from verl_fast.kernels import decode_attention as A
    from verl_fast.kernels import linear_logprobs as L
    from verl_fast.kernels import logprobs_from_logits as P

    N, H, V, C = 8192, 3584, 151936, 4096
    f32, i64 = torch.float32, torch.int64
    vec = torch.empty(N, dtype=f32)
    labels = torch.empty(N, dtype=i64)
    for dtype, ent, bias in ((torch.bfloat16, True, True), (torch.float16, False, False), (f32, True, False)):
        cfg = L.linear_config(N, H, V, dtype, device)
        h, w = torch.empty(N, H, dtype=dtype), torch.empty(V, H, dtype=dtype)
        b = torch.empty(V, dtype=dtype) if bias else None
        buf, dh = torch.empty(N, C, dtype=dtype), torch.empty(N, H, dtype=f32)
        dot = dict(PRECISION="ieee" if dtype == f32 else "tf32", UPCAST=False)
        ltag = f"{str(dtype)[6:]}{' +entropy' if ent else ''}"
        tag = f"{ltag}{' +bias' if bias else ''}"
        yield (f"linear fwd {tag} {cfg.forward}", L._linear_fwd_kernel,
               (h, w, b, labels, vec, vec, vec, vec, N, V, H, H, 1, H, 1, 1.0, 0, 297, 2),
               dict(HAS_BIAS=bias, WITH_ENT=ent, EVEN_K=True, TMA=False, **dot, **L._launch(cfg.forward)))
        yield (f"linear dlogits {tag} {cfg.dlogits}", L._linear_dlogits_kernel,
               (h, w, b, labels, vec, vec, vec, vec, buf, vec if bias else None, N, V, H, 0, C, H, 1, H, 1, C, 1.0, 0),
               dict(HAS_BIAS=bias, HAS_GLP=True, HAS_GENT=ent, NEED_DB=bias, EVEN_K=True, TMA=False, **dot,
                    **L._launch(cfg.dlogits)))
        if dtype == torch.bfloat16:  # the TMA variant the benchmark sweeps
            tma = L.replace(cfg.forward, tma=True)
            h_desc, w_desc, _ = L._logits_operands(h, w, tma)
            yield (f"linear fwd {tag} {tma}", L._linear_fwd_kernel,
                   (h_desc, w_desc, b, labels, vec, vec, vec, vec, N, V, H, H, 1, H, 1, 1.0, 0, 297, 2),
                   dict(HAS_BIAS=bias, WITH_ENT=ent, EVEN_K=True, TMA=True, **dot, **L._launch(tma)))
            yield (f"linear dlogits {tag} {tma}", L._linear_dlogits_kernel,
                   (h_desc, w_desc, b, labels, vec, vec, vec, vec, buf, vec, N, V, H, 0, C, H, 1, H, 1, C, 1.0, 0),
                   dict(HAS_BIAS=bias, HAS_GLP=True, HAS_GENT=ent, NEED_DB=bias, EVEN_K=True, TMA=True, **dot,
                        **L._launch(tma)))
        yield (f"linear dhidden {str(dtype)[6:]} {cfg.dhidden}", L._matmul_acc_kernel,
               (buf, w, dh, N, H, C - 8, C, 1, H, 1, H, 1), dict(EVEN_K=False, **dot, **L._launch(cfg.dhidden)))
        lp = P.logprobs_config(V)
        x = torch.empty(1, N, V, dtype=dtype)
        bad = torch.zeros(1, dtype=torch.int32)  # the label-range count
        yield (f"logprobs fwd {ltag} {lp}", P._logprobs_fwd_kernel,
               (x, labels, vec, vec, vec, bad if ent else None, N, 0, V, 1, V, 1.0),
               dict(WITH_ENT=ent, CHECK=ent, BLOCK_V=lp.block_v, NUM_STAGES=lp.num_stages, num_warps=lp.num_warps))
        yield (f"logprobs bwd {ltag} {lp}", P._logprobs_bwd_kernel,
               (x, x, labels, vec, vec, vec, vec if ent else None, N, 0, V, 1, V, 1.0),
               dict(HAS_GLP=True, HAS_GENT=ent, BLOCK_V=lp.block_v, num_warps=lp.num_warps))
    # the decode step's attention at the 7B shape (28 query heads over 4 KV heads, head_dim 128, 128
    # sequences, a 320-column cache), whole (bf16, fp32) and split over the columns with its combine
    B, KVH, G, L, D = 128, 4, 7, 320, 128
    for dtype, split in ((torch.bfloat16, False), (torch.bfloat16, True), (f32, False)):
        q, kv = torch.empty(B, KVH * G, 1, D, dtype=dtype), torch.empty(B, KVH, L, D, dtype=dtype)
        keep, out = torch.empty(B, L, dtype=torch.bool), torch.empty(B, 1, KVH * G, D, dtype=dtype)
        part = torch.empty(B * KVH * 2 * 16 * D, dtype=f32)
        yield (f"decode attention {str(dtype)[6:]}{' split' if split else ''}", A._decode_attention_kernel,
               (q, kv, kv, keep, out, part, part, part, KVH, L, G, D, 192 if split else L, 0.1, *q.stride()[:2],
                q.stride(3), *kv.stride(), *kv.stride(), *keep.stride(), out.stride(0), out.stride(2), out.stride(3)),
               dict(BLOCK_G=16, BLOCK_N=A.BLOCK_N, BLOCK_D=D, SPLIT=split, PRECISION="ieee" if dtype == f32 else "tf32",
                    UPCAST=False, NUM_STAGES=A.NUM_STAGES, num_warps=A.NUM_WARPS))
    yield ("decode attention combine", A._combine_kernel, (out, part, part, part, KVH, G, D, 2, out.stride(0),
           out.stride(2), out.stride(3)), dict(BLOCK_G=16, BLOCK_D=D, num_warps=4))


def _as_inductor_calls(kernel, pointers: dict, constexprs: dict):
    """Compiles ``kernel`` with the scalar types Inductor gives it inside a compiled graph: Python floats
    as fp64 (a launch from Python passes fp32), the other scalars i32 (no specialization hints: the
    register counts printed are not the launched kernel's)."""
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    sig.update({n: "fp64" for n in names if n.startswith("scale")})
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=triton.runtime.driver.active.get_current_target())


def _inductor_variants():
    from verl_fast.kernels import decode_attention as A

    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "mask_ptr": "*i1",
                "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32"}
    for split in (False, True):
        yield (f"decode attention bfloat16{' split' if split else ''}, as Inductor calls it", A._decode_attention_kernel,
               pointers, dict(BLOCK_G=16, BLOCK_N=A.BLOCK_N, BLOCK_D=128, SPLIT=split, PRECISION="tf32", UPCAST=False,
                             NUM_STAGES=A.NUM_STAGES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter never compiles", file=sys.stderr)
        return 2
    triton.runtime.driver.set_active(_TargetOnlyDriver(args.arch))
    from verl_fast.kernels import linear_logprobs as L

    # Block sizes as linear_config picks them on such a device (H100/H200: 227 KiB shared memory).
    L._device_limits = lambda device: ("sm90", 232448) if args.arch >= 90 else ("sm80", 166912)
    device = torch.device("cpu")
    failures = 0
    for name, kernel, call_args, options in _variants(device):
        try:
            compiled = kernel.warmup(*call_args, grid=(1,), **options)
            info = _ptxas_info(compiled.asm["ptx"], args.arch)
            print(f"ok    {name}: {info}, {compiled.metadata.shared} B shared")
        except Exception as e:  # report every kernel, then fail
            failures += 1
            print(f"FAIL  {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    for name, kernel, pointers, constexprs in _inductor_variants():
        try:
            compiled = _as_inductor_calls(kernel, pointers, constexprs)
            print(f"ok    {name}: {_ptxas_info(compiled.asm['ptx'], args.arch)}")
        except Exception as e:
            failures += 1
            print(f"FAIL  {name}: {type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
