"""The decode step's fused Triton kernels (kernels/rope_cache.py, kernels/decode_sampling.py) compile for
an H100 (sm_90) on a machine without a GPU: Triton's ahead-of-time compile for a named target, through
ptxas to a cubin, in a process of its own (the CPU tests' interpreter, TRITON_INTERPRET, replaces the
compiler). It checks that the kernels lower for the target; register use and speed need the GPU."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def compile_all() -> list:
    """Each kernel variant compiled for sm_90: (name, cubin bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from verl_fast.kernels.decode_sampling import BLOCK, NUM_WARPS, _sample_kernel
    from verl_fast.kernels.rope_cache import _rope_cache_kernel

    def signature(kernel, pointers):  # every argument not named: an int32 (sizes, strides)
        return {name: pointers.get(name, "i32") for name in kernel.arg_names}

    built = []
    for greedy in (True, False):
        sig = signature(_sample_kernel, {
            "logits_ptr": "*fp32", "seed_ptr": "*i64", "t_ptr": "*i64", "done_ptr": "*i1", "pad_ptr": "*i64",
            "stop_ptr": "*i64", "tokens_ptr": "*i64", "logprobs_ptr": "*fp32", "current_ptr": "*i64",
            "position_ptr": "*i64", "temperature": "fp32", "GREEDY": "constexpr", "BLOCK": "constexpr"})
        src = ASTSource(_sample_kernel, sig, constexprs={"GREEDY": greedy, "BLOCK": BLOCK})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
        built.append((f"sample greedy={greedy}", kernel))
    for cache in ("*bf16", "*fp32"):
        sig = signature(_rope_cache_kernel, {
            "qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": "*fp32", "k_ptr": cache,
            "v_ptr": cache, "col_ptr": "*i64", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"})
        src = ASTSource(_rope_cache_kernel, sig, constexprs={"BLOCK_R": 32, "BLOCK_D": 64})
        built.append((f"rope_cache {cache}", triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                                              options={"num_warps": 4})))
    return [(name, len(k.asm["cubin"]), ".target sm_90" in k.asm["ptx"]) for name, k in built]


def test_the_fused_decode_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [line.split("\t") for line in done.stdout.splitlines() if "\t" in line]
    assert len(results) == 4, done.stdout
    for name, size, target in results:
        assert int(size) > 0 and target == "True", (name, size, target)


if __name__ == "__main__":
    for name, size, target in compile_all():
        print(f"{name}\t{size}\t{target}")
