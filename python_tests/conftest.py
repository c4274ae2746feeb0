import os

import pytest
import torch

# Triton kernels run on CPU tensors only under its interpreter, which must be chosen before Triton
# is imported (the op wrappers import the kernels lazily, so this is early enough).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Parametrise a test over devices with DEVICES: the CUDA case carries the gpu mark.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
