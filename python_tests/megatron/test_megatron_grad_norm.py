"""The foreach gradient norm that replaces megatron-core's host-side fallback: the same total norm as
megatron-core's own (and as a float64 reference) through its get_grad_norm_fp32; on the GPU, no
device-to-host synchronisation."""

import socket

import pytest
import torch

pytest.importorskip("megatron.core")


def grads(device="cpu"):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 6), (1,), (64, 33)]
    return [(torch.randn(s, generator=g) * (i + 1)).to(device) for i, s in enumerate(shapes)]


def test_foreach_norm_matches_megatron_fallback():
    import torch.distributed as dist
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from megatron_worker import CudaOnCpu
    from verl_fast.strategies.megatron.grad_norm import foreach_l2_norm, use_foreach_grad_norm

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    saved = clip_grads.l2_norm_impl
    try:
        clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
        tensors = grads()
        want = torch.cat([t.double().flatten() for t in tensors]).norm().item()
        with CudaOnCpu():  # megatron-core makes its scratch tensors on "cuda"
            theirs = clip_grads.get_grad_norm_fp32(tensors, 2, dist.group.WORLD)
            use_foreach_grad_norm()
            assert clip_grads.l2_norm_impl is foreach_l2_norm
            ours = clip_grads.get_grad_norm_fp32(tensors, 2, dist.group.WORLD)
        assert ours == pytest.approx(want, rel=1e-6) and theirs == pytest.approx(want, rel=1e-6)
    finally:
        clip_grads.l2_norm_impl = saved
        dist.destroy_process_group()


def test_foreach_norm_refuses_per_tensor():
    from verl_fast.strategies.megatron.grad_norm import foreach_l2_norm

    with pytest.raises(ValueError, match="per_tensor"):
        foreach_l2_norm(0, None, [grads()], True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_foreach_norm_does_not_synchronise():
    from verl_fast.strategies.megatron.grad_norm import foreach_l2_norm

    tensors = grads("cuda")
    want = torch.cat([t.double().flatten() for t in tensors]).norm().item()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait raises
    try:
        norm, _ = foreach_l2_norm(0, None, [tensors], False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert norm.shape == (1,) and norm.item() == pytest.approx(want, rel=1e-6)
