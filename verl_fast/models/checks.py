"""Checks of a model folder before it loads, and of loaded models, each failure one line naming the
file (or the config key) and what is wrong.

Before loading (``check_folder``; a local folder, or a Hub name's snapshot in the HF cache):
- every entry transformers may read is a regular file: a FIFO would block the load forever, a device
  (``model.safetensors`` as /dev/zero) be read without end;
- a symbolic link whose target lies outside the folder is refused (its text would become, e.g., the
  chat template, copied into every checkpoint, export and Hub upload); a Hub snapshot's links into
  its own ``blobs/`` are how the HF cache stores files and pass;
- ``config.json`` and ``tokenizer_config.json`` are JSON objects, each ``*.safetensors`` has a
  header (8-byte length, then a JSON object whose offsets lie inside the file);
- ``rollout.max_new_tokens`` fits the model's context (``max_position_embeddings``, stretched by a
  YaRN / linear / dynamic RoPE scaling).

After loading: weights the folder lacks (``missing_weights``: transformers would leave them at their
random initial values) and a reference model with another vocabulary than the actor's (``same_vocab``).
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

_JSON_FILES = ("config.json", "tokenizer_config.json")
_MAX_JSON = 64 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


def _allowed_root(folder: Path) -> Path:
    """Where links may point: the folder, or for an HF cache snapshot (``.../snapshots/<rev>``) the
    repository's cache folder (its ``blobs/``)."""
    real = folder.resolve()
    return real.parent.parent if real.parent.name == "snapshots" else real


def _entries(folder: Path) -> Iterable[Path]:
    for entry in sorted(folder.iterdir()):
        yield entry
        if entry.name == "additional_chat_templates" and entry.is_dir() and not entry.is_symlink():
            yield from sorted(entry.iterdir())


def _check_entry(entry: Path, root: Path, key: str) -> None:
    if entry.is_symlink():
        target = entry.resolve()
        if root != target and root not in target.parents:
            raise ValueError(f"{key}: {entry} is a symbolic link to {os.readlink(entry)}, outside the model folder: "
                             "a model folder's files must lie inside it (copy the file in instead)")
    try:
        mode = os.stat(entry).st_mode
    except FileNotFoundError:
        raise ValueError(f"{key}: {entry} is a broken symbolic link (to {os.readlink(entry)})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
            "a socket"
        raise ValueError(f"{key}: {entry} is {kind}, not a file: a model folder holds regular files")


def _json_object(path: Path, key: str) -> Dict[str, Any]:
    if path.stat().st_size > _MAX_JSON:
        raise ValueError(f"{key}: {path} is larger than {_MAX_JSON >> 20} MiB, not a model's {path.name}")
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{key}: {path} is not JSON ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{key}: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def safetensors_names(path: Path, key: str) -> Dict[str, Any]:
    """The header of the safetensors file ``path`` (tensor name -> dtype, shape, data_offsets),
    refused naming the file when it is empty, cut short or not a safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{key}: {path} is {size} bytes, too short for a safetensors file (damaged or empty)")
        (length,) = struct.unpack("<Q", head)
        if length < 2 or length > _MAX_HEADER or 8 + length > size:
            raise ValueError(f"{key}: {path} is not a complete safetensors file (header of {length:,} bytes in a "
                             f"file of {size:,})")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        raise ValueError(f"{key}: {path}: its safetensors header is not JSON (damaged)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{key}: {path}: its safetensors header is not a JSON object (damaged)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - length
    for name, info in tensors.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data):
            raise ValueError(f"{key}: {path}: tensor {name} lies outside the file's {data:,} data bytes (the file "
                             "is cut short or damaged)")
    if not tensors:
        raise ValueError(f"{key}: {path} holds no tensors (an empty header)")
    return tensors


# RoPE scalings that stretch a context of original_max_position_embeddings (else max_position_embeddings)
# positions by their factor; llama3's and longrope's configs state the stretched length itself
_STRETCHING_ROPE = ("yarn", "linear", "dynamic")


def _positive_int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _scaled_positions(section: Dict[str, Any], positions: int) -> int:
    """``positions`` stretched by the section's RoPE scaling (``rope_scaling``, transformers 5's
    ``rope_parameters``), as Qwen's model cards add YaRN for contexts past the trained one while their
    config keeps ``max_position_embeddings``."""
    rope = section.get("rope_scaling") or section.get("rope_parameters")
    if not isinstance(rope, dict) or (rope.get("rope_type") or rope.get("type")) not in _STRETCHING_ROPE:
        return positions
    factor = rope.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        return positions
    base = _positive_int(rope.get("original_max_position_embeddings")) or positions
    return max(positions, int(base * factor))


def context_length(config: Dict[str, Any]) -> Optional[int]:
    """The model's positions (``max_position_embeddings``, GPT-2's ``n_positions``; a multimodal
    config's ``text_config``; stretched by a YaRN / linear / dynamic RoPE scaling), None when the
    config gives none."""
    for section in (config, config.get("text_config") or {}):
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = _positive_int(section.get(name)) if isinstance(section, dict) else None
            if value is not None:
                return _scaled_positions(section, value)
    return None


def check_folder(folder: Path, key: str, max_new_tokens: Optional[int] = None) -> None:
    """The checks before loading (see the module docstring); ``key`` names the config key."""
    root = _allowed_root(folder)
    for entry in _entries(folder):
        _check_entry(entry, root, key)
    for name in _JSON_FILES:
        if (folder / name).is_file():
            _json_object(folder / name, key)
    for path in sorted(folder.glob("*.safetensors")):
        safetensors_names(path, key)
    config_path = folder / "config.json"
    if max_new_tokens is not None and config_path.is_file():
        positions = context_length(_json_object(config_path, key))
        if positions is not None and max_new_tokens >= positions:
            raise ValueError(f"rollout.max_new_tokens={max_new_tokens} does not fit {key}'s context of {positions} "
                             f"positions ({config_path}: its max_position_embeddings, times its RoPE scaling's factor where "
                             f"it has one): at most {positions - 1}, less "
                             "the prompt's tokens")


def missing_weights(loading_info: Dict[str, Any], name: str, key: str) -> None:
    """Refuses a load whose checkpoint lacked weights of the model (``output_loading_info``)."""
    missing = sorted(loading_info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{key}={name}: the weights file lacks {len(missing)} of the model's tensors ({shown}); "
                         "they would train from random values: the checkpoint is incomplete or of another model")


def vocab_rows(model: Any) -> int:
    embeddings = model.get_input_embeddings()
    return int(embeddings.weight.shape[0])


def same_vocab(actor: Any, reference: Any) -> None:
    """Refuses a reference model whose vocabulary differs from the actor's (its log-probs of the
    actor's tokens would index past its rows, or mean other tokens)."""
    a, r = vocab_rows(actor), vocab_rows(reference)
    if a != r:
        raise ValueError(f"ref_model has a vocabulary of {r} tokens and the actor {a}: the reference scores the "
                         "actor's tokens, so both need the same tokenizer and vocabulary")
