"""Float64 references, backends and tolerances shared by the log-prob tests."""

import importlib.util
import os

import pytest
import torch


def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


# (device, backend): the chunked torch path, the Triton kernels under the interpreter (CPU tensors),
# and the Triton kernels on a GPU.
BACKENDS = [
    pytest.param(("cpu", "torch"), id="cpu-torch"),
    pytest.param(("cpu", "triton"), id="cpu-triton",
                 marks=pytest.mark.skipif(not _interpreter(), reason="needs Triton with TRITON_INTERPRET=1")),
    pytest.param(("cuda", "triton"), id="cuda-triton", marks=pytest.mark.gpu),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Gradients are rounded to the input dtype (and, in the Triton path, d_logits is stored in it once),
# so their tolerance is relative to the largest gradient entry. Values are computed in fp32 from the
# exact inputs in every dtype, so one tolerance serves all.
GRAD_RTOL = {torch.float32: 2e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}


def reference(z64: torch.Tensor, labels: torch.Tensor):
    """(logp, entropy) of labels under softmax(z64), z64 = logits / T in float64."""
    logp_all = torch.log_softmax(z64, dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    # 0 * log 0 = 0 for logits of -inf (a vocabulary mask), in the values and in the gradient
    entropy = -(logp_all.exp() * logp_all.clamp(min=-1e300)).sum(-1)
    return logp, entropy


def assert_values(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-4) -> None:
    assert actual.dtype == torch.float32, f"{what}: expected float32, got {actual.dtype}"
    torch.testing.assert_close(actual.double().cpu(), expected.cpu(), atol=atol, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def assert_grad(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, rtol=None) -> None:
    assert actual is not None, f"{what}: no gradient"
    assert actual.dtype == dtype, f"{what}: gradient dtype {actual.dtype}, expected {dtype}"
    scale = max(expected.abs().max().item(), 1e-3)
    err = (actual.double().cpu() - expected.cpu()).abs().max().item()
    tol = (rtol or GRAD_RTOL[dtype]) * scale + 1e-6  # + fp32 rounding of the summed terms (~1e-7 each)
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g} (largest entry {scale:.3g}, {dtype})"
