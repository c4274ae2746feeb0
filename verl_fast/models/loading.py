"""Loading models and tokenizers by name for the CLI (the Python API takes model objects): a local
folder, the demo alias, or a Hub name, which transformers finds in the HF cache or fetches
(``HF_HUB_OFFLINE`` respected); a name found nowhere is one line (``verl_fast.files.hub.NameNotFound``)."""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from verl_fast.files import hub

DEMO_ALIASES = ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "demo")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)
HALF_CHECKS = {"bfloat16": "_is_mkldnn_bf16_supported", "float16": "_is_mkldnn_fp16_supported"}  # torch's own


def cpu_has_native(dtype: str) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices with its own instructions (AVX-512 BF16 / FP16, AMX);
    without them torch emulates the products, tens of times slower than float32's."""
    if dtype not in HALF_CHECKS:
        return True
    check = getattr(torch.ops.mkldnn, HALF_CHECKS[dtype], None)
    return bool(check is not None and check())


def load_dtype(dtype: str, on_cpu: bool, key: str) -> str:
    """The dtype to load a model in for ``key`` (``actor.dtype``...): ``dtype``, except a 16-bit one on a CPU
    that only emulates it, where the model is loaded in float32 with a one-line notice (a CPU run of a GPU
    config, such as the examples': the same training, in float32, its exports in float32 too)."""
    if not on_cpu or cpu_has_native(dtype):
        return dtype
    logger.warning("%s=%s on a CPU without %s matrix instructions: loading in float32 (torch emulates %s products "
                   "there, tens of times slower)", key, dtype, dtype, dtype)
    return "float32"


def resolve(name: str) -> str:
    """A local folder for ``name``: the demo model's cached folder for its alias, a folder as it is,
    or the HF cache's snapshot of a Hub name (fetched by an earlier ``load_causal_lm``)."""
    if name in DEMO_ALIASES:
        from verl_fast.models.demo import demo_model_path

        return str(demo_model_path())
    return hub.model_folder(name)


def local_folder(name: Optional[str]) -> Optional[Path]:
    """The folder ``name`` (a path, the demo alias, or a Hub name already in the HF cache) names on
    this machine, without downloading anything; None when there is none yet. The demo alias's folder
    is converted from its package here when it is not yet (the load that follows would convert it)."""
    if not name:
        return None
    if os.path.isdir(name):
        return Path(name)
    if name in DEMO_ALIASES:
        return Path(resolve(name))
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or not a Hub name): transformers says so when it loads
        return None


def pretrained(auto_class: Any, name: str, what: str, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained(name, **kwargs)`` (the demo alias resolved), a name found nowhere
    raised as NameNotFound naming ``what`` (the config key)."""
    path = str(resolve(name)) if name in DEMO_ALIASES else name
    return hub.load_with(lambda n: auto_class.from_pretrained(n, **kwargs), what, path)


def attention_kwargs(section: Any, key: str, cuda: bool) -> Dict[str, Any]:
    """``from_pretrained`` keywords from a config section's ``attn_implementation`` /
    ``trust_remote_code`` (and the critic's ``use_flash_attention``); ``key`` names the section in
    messages. An explicit flash_attention_2 without the flash-attn package is an error; the
    ``use_flash_attention`` switch falls back to sdpa with a warning where flash-attn or CUDA is missing."""
    attn = section.attn_implementation
    flash_ok = importlib.util.find_spec("flash_attn") is not None
    if attn == "flash_attention_2" and not flash_ok:
        raise ValueError(f"{key}.attn_implementation=flash_attention_2 needs the flash-attn package, which is not "
                         "installed (pip install flash-attn, on a CUDA machine); use sdpa or leave it unset")
    if attn is None and getattr(section, "use_flash_attention", False):
        if flash_ok and cuda:
            attn = "flash_attention_2"
        else:
            warnings.warn(f"{key}.use_flash_attention: flash-attn "
                          f"{'needs a CUDA device' if flash_ok else 'is not installed'}; using sdpa", UserWarning)
            attn = "sdpa"
    kwargs: Dict[str, Any] = {"trust_remote_code": section.trust_remote_code}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    return kwargs


def load_causal_lm(name: str, dtype: str = "float32", what: str = "actor.model_name",
                   **kwargs: Any) -> Tuple[Any, Any]:
    """Model and tokenizer by name (see the module docstring); ``what`` names the config key in
    errors; ``kwargs`` (``attn_implementation``, ``trust_remote_code``) go to ``from_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from verl_fast.models.vision_processor import VisionProcessor
    from verl_fast.models.checks import missing_weights

    remote = kwargs.get("trust_remote_code", False)
    config = pretrained(AutoConfig, name, what, trust_remote_code=remote)
    vlm = getattr(config, "vision_config", None) is not None  # its processor (images and text) stands as tokenizer
    model, info = pretrained(AutoModelForImageTextToText if vlm else AutoModelForCausalLM, name, what,
                             dtype=DTYPES[dtype], output_loading_info=True, **kwargs)
    missing_weights(info, name, what)
    if vlm:
        return model, VisionProcessor.from_pretrained(resolve(name))
    tokenizer = pretrained(AutoTokenizer, name, what, trust_remote_code=remote)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
