"""SDPAttention (torch's fused attention as megatron-core's core attention) against megatron-core's own
DotProductAttention and a float64 reference written here: outputs and gradients, with and without
grouped-query attention, with megatron-core's boolean causal mask and with the causal layer type alone."""

import contextlib
import math
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402


@pytest.fixture(scope="module")
def megatron_tp1():
    """A one-process gloo world with megatron-core's parallel state (TP=1), CUDA calls neutralised."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")  # megatron-core's score buffer
    # its attention-dropout RNG region
    mp.setattr(mrandom.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    mp.undo()


def config(heads, groups, hn, dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * hn, num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=hn, attention_dropout=0.0, masked_softmax_fusion=False,
                             params_dtype=dtype, use_cpu_initialization=True)


def reference(q, k, v):
    """Causal softmax attention in float64: q [s, b, np, hn], k / v [s, b, ng, hn] -> [s, b, np * hn]."""
    s, b, heads, hn = q.shape
    rep = heads // k.shape[2]
    q, k, v = (x.double() for x in (q, k, v))
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(hn)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(s, b, heads * hn)


def run(module, q, k, v, mask, grad_out):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(grad_out)
    return out.detach(), [x.grad for x in (q, k, v)]


@pytest.mark.parametrize("heads,groups", [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sdpa_matches_dot_product_attention(megatron_tp1, heads, groups, dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from verl_fast.strategies.megatron.attention import SDPAttention

    s, b, hn = 11, 3, 8
    cfg = config(heads, groups, hn, dtype)
    g = torch.Generator().manual_seed(heads * 10 + groups)
    q = torch.randn(s, b, heads, hn, generator=g, dtype=dtype)
    k, v = (torch.randn(s, b, groups, hn, generator=g, dtype=dtype) for _ in range(2))
    grad_out = torch.randn(s, b, heads * hn, generator=g, dtype=dtype)
    causal_mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True = masked out, as the actor builds it
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)

    theirs = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    ours = SDPAttention(cfg, 1, AttnMaskType.causal, "self")
    ref_out, ref_grads = run(theirs, q, k, v, causal_mask, grad_out)
    # float64 reference of the forward: megatron-core itself is checked too
    torch.testing.assert_close(ref_out.double(), reference(q, k, v), **tol)
    for mask in (causal_mask, None):  # the explicit mask, and the causal type alone (is_causal)
        out, grads = run(ours, q, k, v, mask, grad_out)
        torch.testing.assert_close(out, ref_out, **tol)
        for name, got, want in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"grad of {name}: {m}")


def test_sdpa_refuses_what_it_does_not_do(megatron_tp1):
    from verl_fast.strategies.megatron.attention import SDPAttention

    cfg = config(4, 2, 8, torch.float32)
    cfg.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout"):
        SDPAttention(cfg, 1, AttnMaskType.causal, "self")
    ours = SDPAttention(config(4, 2, 8, torch.float32), 1, AttnMaskType.causal, "self")
    q, k = torch.randn(5, 1, 4, 8), torch.randn(5, 1, 2, 8)
    with pytest.raises(ValueError, match="boolean"):
        ours(q, k, k, torch.zeros(1, 1, 5, 5))


@pytest.mark.skipif(torch.cuda.is_available(), reason="MegatronGPT builds on the GPU when there is one")
def test_megatron_gpt_layers_use_sdpa(megatron_tp1):
    import transformers

    from verl_fast.strategies.megatron.attention import SDPAttention
    from verl_fast.strategies.megatron.gpt_model import MegatronGPT, Parallel

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32)
    model = MegatronGPT(cfg, Parallel())
    cores = [m.core_attention for m in model.chunks[0].modules() if hasattr(m, "core_attention")]
    assert len(cores) == 2 and all(isinstance(c, SDPAttention) for c in cores)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mask", [False, True])
def test_sdpa_flash_on_gpu(mask):
    """The 1.5B model's per-rank shape at TP=2 (6 query heads, 1 KV head, head dim 128) in bf16: without a
    mask the causal layer runs on the flash kernel alone (it raises if torch would choose another)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from verl_fast.strategies.megatron.attention import SDPAttention

    s, b, heads, groups, hn = 512, 2, 6, 1, 128
    ours = SDPAttention(config(heads, groups, hn, torch.bfloat16), 1, AttnMaskType.causal, "self")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s, b, heads, hn, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(s, b, groups, hn, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    grad_out = torch.randn(s, b, heads * hn, generator=g, device="cuda", dtype=torch.bfloat16)
    explicit = torch.ones(1, 1, s, s, dtype=torch.bool, device="cuda").triu(1) if mask else None
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION] if mask else [SDPBackend.FLASH_ATTENTION]
    with sdpa_kernel(backends):
        out, grads = run(ours, q, k, v, explicit, grad_out)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    want = reference(qd, kd, vd)
    want.backward(grad_out.double())
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    for name, got, ref in zip("qkv", grads, (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(got.double(), ref, atol=1e-1, rtol=5e-2, msg=lambda m: f"grad of {name}: {m}")
