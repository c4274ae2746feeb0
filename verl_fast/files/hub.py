"""Names on the Hugging Face Hub: what a model or dataset name that is neither a local folder nor
found means (one line), where a Hub model's files lie once transformers fetched them, and the upload
of an HF export (``trainer.hub_model_id``).

Loading itself is transformers' and datasets' own (``from_pretrained``, ``load_dataset``), so the HF
cache (``HF_HOME`` / ``HF_HUB_CACHE``) and ``HF_HUB_OFFLINE=1`` work as they do with every peer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Sequence

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class NameNotFound(FileNotFoundError):
    """A model or dataset name that is neither a local folder nor found in the HF cache or on the Hub."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` can be a Hub repository (``name`` or ``org/name``)."""
    return bool(_REPO_ID.fullmatch(name)) and not name.endswith((".parquet", ".jsonl", ".json", ".pt", ".pth"))


def not_found(what: str, name: str, error: BaseException) -> NameNotFound:
    """The one-line error for ``what`` (e.g. ``actor.model_name``) ``name`` that loading failed on."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    where = "not in the HF cache (HF_HUB_OFFLINE is set)" if offline else "not in the HF cache nor reachable on the Hub"
    cause = " ".join(str(error).split())[:300]
    return NameNotFound(f"{what}={name}: no such local folder, and {where}; give a local folder, a Hub name in "
                        f"the cache (HF_HOME / HF_HUB_CACHE), or run where the Hub is reachable ({cause})")


def model_folder(name: str) -> str:
    """The local folder of model ``name``: itself when it is one, else the HF cache's snapshot that
    transformers loaded it from (what vLLM then loads, with the same files)."""
    if Path(name).is_dir():
        return name
    from transformers.utils import cached_file

    return str(Path(cached_file(name, "config.json")).parent)


def upload(folder: Path, repo_id: str, private: bool = True, message: str = "verl_fast export",
           ignore: Sequence[str] = ()) -> str:
    """Uploads the HF export in ``folder`` (less the ``ignore`` patterns) to the model repository
    ``repo_id``, created when missing (``private`` then), through huggingface_hub's ``HfApi`` (the
    token of HF_TOKEN / ``hf auth login``); returns the repository's URL."""
    from huggingface_hub import HfApi

    from verl_fast.errors import UserError, one_line

    try:
        api = HfApi()
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=message,
                          ignore_patterns=list(ignore) or None)
    except Exception as e:  # no network, no token, refused by the Hub: the folder stays as it is
        raise UserError(f"trainer.hub_model_id={repo_id}: the upload of {folder} failed ({type(e).__name__}: "
                        f"{one_line(e)}); the checkpoint is kept: upload it later with "
                        f"`hf upload {repo_id} {folder}`") from e
    return str(getattr(url, "url", url))


def load_with(load: Callable[[str], Any], what: str, name: str) -> Any:
    """``load(name)``; an OSError (not found, unreachable, offline) for a name that is not a local
    path becomes ``NameNotFound`` naming ``what``."""
    try:
        return load(name)
    except OSError as e:
        if os.path.exists(name) or isinstance(e, NameNotFound):
            raise
        raise not_found(what, name, e) from None
