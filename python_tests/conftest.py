import os
import sys
from pathlib import Path

# `python -m pytest` puts the working directory first on sys.path; from the repository root that
# would import the source folder verl_fast/ (which lacks the built _C, installed beside it) instead
# of the installed package. Test what is installed (an editable install maps the source folder itself, so it is found either way).
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
# The tests sit in one folder per room; what several rooms' tests share (tiny models, float64
# references, the workers that subprocess and multiprocessing tests start) is in support/.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run on CPU tensors only under its interpreter, which must be chosen before Triton
# is imported (the op wrappers import the kernels lazily, so this is early enough).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests validate configs directly (verl_fast.config.from_dict): the modules that own the
# config's choices register them first, as `verl-fast train` and RLTrainer do.
from verl_fast.trainer import catalog  # noqa: E402

catalog.register()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Parametrise a test over devices with DEVICES: the CUDA case carries the gpu mark.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def full_fp32_matmuls():
    """Full float32 matrix products and convolutions on a GPU for the test (the decode tests compare
    tokens exactly; a process may turn TF32 on, as ``trainer.tf32`` says), restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
