"""Sharded, verified checkpoints (torch DCP) and their Hugging Face export.

Layout of ``<output_dir>/checkpoints/step_000010/``:
- ``dcp/``: torch.distributed.checkpoint files; every rank writes its own shards of the actor,
  its optimizer state (and the critic's), so no rank ever holds the whole model. DCP reshards on
  load, so a checkpoint saved by N processes resumes in M (an FSDP2 actor resumes as a plain one).
- ``config.json``, ``generation_config.json``, tokenizer files: the actor's HF metadata.
- ``model.safetensors`` (or shards + index): the HF export that transformers and vLLM load, written
  from ``dcp/`` at the end of a run (``trainer.hf_export: final``; ``every`` for each checkpoint) and
  on demand by ``verl-fast export``.
- ``trainer_state.json``: step, metrics history, RNG state, config.
- ``manifest.json``: size and CRC-32 of every file above, written last.

The large files (``dcp/`` and the export) are written around the page cache (``direct_write``),
their CRCs taken as they are written.

Writes go to ``step_N.tmp`` and are renamed when the manifest is in place, so a folder named
``step_N`` is complete; on resume each candidate is verified against its manifest, newest first,
and a damaged one is named (file and what is wrong) and skipped for the previous complete one.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import re
import shutil
import stat
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from verl_fast.checkpoint import model_card
from verl_fast.files import output_folder, safe_load
from verl_fast.models import lora
from verl_fast.models.wrapping import hf_module
from verl_fast.files import direct_write, run_files
from verl_fast.files.direct_write import Records
from verl_fast.distributed import gather, on_main, rank_world

_STEP = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
DCP = "dcp"
# files of a checkpoint folder that are not part of the HF export
_NOT_HF = {DCP, MANIFEST, STATE}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder or file."""


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dirs(output_dir: str) -> List[Path]:
    """Finished checkpoint folders, newest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return [p for _, p in sorted(steps, reverse=True)]


# ----------------------------------------------------------------------------- checksums


def _checksums(folder: Path, files: List[str], written: Optional[Records] = None) -> Dict[str, Dict[str, int]]:
    """Size and CRC-32 of ``files`` (relative to ``folder``): those in ``written`` (each rank's
    records of the files it wrote, by path) as recorded, the others read, the work split over the
    ranks. Collective."""
    rank, world = rank_world()
    records: Dict[str, Dict[str, int]] = {}
    if written is not None:
        for part in gather({os.path.relpath(p, folder): {"bytes": n, "crc32": c} for p, (n, c) in written.items()}):
            records.update(part)
    rest = [f for f in files if f not in records]
    mine = {f: _file_record(folder / f) for f in rest[rank::world]}
    for record in mine.values():
        if "error" in record:
            record["rank"] = rank
    for part in gather(mine):
        records.update(part)
    return {f: records[f] for f in files}


def records_to_publish(folder: Path, files: List[str], written: Optional[Records] = None) -> Dict[str, Dict[str, int]]:
    """``_checksums`` of a checkpoint being written, refusing one that some rank could not read: ranks
    writing into folders that are not one shared folder (another path on each rank, or a node's local
    disk) would otherwise publish a checkpoint that every resume finds damaged. Collective."""
    records = _checksums(folder, files, written)
    for name, record in records.items():
        if "error" in record:
            raise CheckpointError(
                f"{folder / name}: {record['error']} on rank {record['rank']}, which checksums it: every rank "
                "must write to and read from the same checkpoint folder (trainer.output_dir: one path, on a "
                "filesystem that all ranks share)")
    return records


def _file_record(path: Path) -> Dict[str, Any]:
    """Size and CRC-32 of the regular file ``path``, read without following a symbolic link (and
    without blocking on a FIFO: anything but a regular file is an error, never read)."""
    crc, size = 0, 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {"bytes": -1, "crc32": -1, "error": "not a regular file"}
            while chunk := f.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
    except OSError as e:  # reported by verify (every rank must still reach the gather)
        reason = "a symbolic link" if e.errno == errno.ELOOP else e.strerror or str(e)
        return {"bytes": -1, "crc32": -1, "error": reason}
    return {"bytes": size, "crc32": crc}


def checkpoint_files(folder: Path) -> List[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


# ----------------------------------------------------------------------------- saving


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes one process, which is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _state(actor, optimizer, critic, critic_optimizer) -> Dict[str, Any]:
    """What DCP writes: each rank's shards of the models and optimizer states (no gathering)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"actor": get_model_state_dict(actor), "actor_optim": get_optimizer_state_dict(actor, optimizer)}
    if critic is not None:
        state["critic"] = get_model_state_dict(critic)
        if critic_optimizer is not None:
            state["critic_optim"] = get_optimizer_state_dict(critic, critic_optimizer)
    return state


def _local_bytes(obj: Any) -> int:
    if isinstance(obj, dict):
        return sum(_local_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_local_bytes(v) for v in obj)
    if hasattr(obj, "local_shards"):  # FSDP1's ShardedTensor
        return sum(_local_bytes(s.tensor) for s in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj  # DTensor: this rank's shard
        if type(local) is not torch.Tensor and hasattr(local, "__tensor_flatten__"):  # a wrapper subclass
            names, _ = local.__tensor_flatten__()  # (torchao's 8-bit optimizer states: codes and scales)
            return sum(_local_bytes(getattr(local, name)) for name in names)
        return local.numel() * local.element_size()
    return 0


def _disk_full_message(root: Path, needed: int, free: int, previous: Optional[Path]) -> str:
    intact = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    from verl_fast.errors import human_bytes

    return (f"not enough disk space for a checkpoint in {root}: about {human_bytes(needed)} needed, "
            f"{human_bytes(free)} free; nothing was written ({intact}). Free space or set trainer.output_dir "
            "elsewhere")


def _is_disk_full(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(e) or "unexpected pos" in str(e):
            return True
        nested = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
        if isinstance(nested, dict) and any(_is_disk_full(x[0] if isinstance(x, tuple) else x)
                                            for x in nested.values()):
            return True
        e = e.__cause__ or e.__context__
    return False


def save(output_dir: str, step: int, actor: torch.nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer,
         state: Dict[str, Any], critic: Optional[torch.nn.Module] = None,
         critic_optimizer: Optional[torch.optim.Optimizer] = None, export_hf: bool = False) -> Path:
    """Writes ``step_<step>`` (every rank calls this; each writes its shards). Raises CheckpointError
    naming the folder when the disk is too full, after removing the partial write."""
    import torch.distributed.checkpoint as dcp

    _, world = rank_world()
    root = checkpoint_root(output_dir)
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    previous = next((p for p in step_dirs(output_dir) if p != final), None)
    shards = _state(actor, optimizer, critic, critic_optimizer)
    # the tensors' bytes (an export writes the actor's weights once more), summed over the ranks
    needed_bytes = sum(gather(_local_bytes(shards) + (_local_bytes(shards["actor"]) if export_hf else 0)))

    def prepare() -> None:
        prepare_root(root)
        run_files.remove(tmp)  # a killed write's leftover (a link by that name: the link only)
        free = shutil.disk_usage(root).free
        if free < needed_bytes:
            raise CheckpointError(_disk_full_message(root, needed_bytes, free, previous))
        (tmp / DCP).mkdir(parents=True)

    on_main(prepare)
    try:
        writer = direct_write.dcp_writer(tmp / DCP)  # around the page cache, CRCs taken while writing
        with _quiet():
            dcp.save(shards, storage_writer=writer, no_dist=world == 1)
        written = dict(getattr(writer.fs, "records", {}))
        # in one process the actor's own tensors are whole: exported as they are, not read back from dcp/
        whole = shards["actor"] if world == 1 and all(type(v) is torch.Tensor or not isinstance(v, torch.Tensor)
                                                        for v in shards["actor"].values()) else None
        written.update(on_main(lambda: _write_metadata(tmp, step, actor, tokenizer, state, export_hf, whole)))
        records = records_to_publish(tmp, on_main(lambda: checkpoint_files(tmp)), written)
        on_main(lambda: publish(tmp, final, records, step))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        on_main(lambda: shutil.rmtree(tmp, ignore_errors=True))
        if _is_disk_full(e):
            free = shutil.disk_usage(root).free
            raise CheckpointError(_disk_full_message(root, needed_bytes, free, previous)) from e
        raise
    return final


def _dominant_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype holding most of ``model``'s parameters."""
    counts: Dict[torch.dtype, int] = {}
    for p in model.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get)


def _write_metadata(tmp: Path, step: int, actor: torch.nn.Module, tokenizer: Any, state: Dict[str, Any],
                    export_hf: bool, whole: Optional[Dict[str, torch.Tensor]] = None) -> Records:
    """Config, tokenizer, trainer state and (``export_hf``) the HF weights; returns the weights'
    files' records."""
    model = hf_module(actor)
    if hasattr(model, "config"):
        config = copy.deepcopy(model.config)
        config.dtype = _dominant_dtype(model)  # what the exported weights are (a LoRA base kept in bf16: bf16)
        config.save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if lora.is_peft(model):  # the adapter (the export merges it into the base weights)
        if whole is not None:
            model.save_pretrained(tmp / lora.ADAPTER)  # peft's own folder: weights and adapter_config.json
        else:  # sharded parameters: the configuration, which the merge needs, only
            model.peft_config[model.active_adapter].save_pretrained(tmp / lora.ADAPTER)
    (tmp / STATE).write_text(json.dumps({"step": step, **state}, indent=1, default=str))
    if not export_hf:
        return {}
    model_card.write(tmp, {"step": step, **state})
    return _write_safetensors(tmp / DCP, tmp, whole=whole)


def publish(tmp: Path, final: Path, records: Dict[str, Dict[str, int]], step: int) -> None:
    """The manifest last (fsynced with everything before it), then the rename that completes it."""
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": records}, indent=1))
    _fsync_tree(tmp)
    if final.is_symlink() or (final.is_dir() and verify(final) is None):
        run_files.remove(final)  # a link (the link only), or this step's complete checkpoint written again
    elif os.path.lexists(final):  # a damaged checkpoint of the same step (or what a user put there): kept
        aside = _set_aside(final)
        _warn(f"{final} (not resumed: damaged) is kept as {aside.name}; remove it when it is not needed")
    os.replace(tmp, final)
    _fsync(final.parent)


def _set_aside(folder: Path) -> Path:
    """Renames ``folder`` to an unused ``<name>.damaged[-k]`` beside it (which no step listing,
    pruning or clean-up matches) and returns the new path."""
    for k in range(1, 10_000):
        aside = folder.with_name(f"{folder.name}.damaged" + (f"-{k}" if k > 1 else ""))
        if not os.path.lexists(aside):
            os.rename(folder, aside)
            return aside
    raise CheckpointError(f"{folder}: too many damaged copies beside it; remove the *.damaged* folders")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            _fsync(p)
    for p in [*(q for q in folder.rglob("*") if q.is_dir()), folder]:
        _fsync(p)


def prepare_root(root: Path) -> None:
    """``checkpoints/``, created if need be; a symbolic link there is refused (every write and
    removal of checkpoints would land where it points)."""
    run_files.refuse_link(root, "the run's checkpoints folder")
    root.mkdir(parents=True, exist_ok=True)


def prune(output_dir: str, keep: int) -> List[Path]:
    """Removes the complete checkpoints of ``output_dir`` older than its ``keep`` newest ones (the
    newest is the one just written); returns those removed. Only ``step_N`` entries of a real
    ``checkpoints/`` folder go, each removed as itself: a link by such a name is unlinked, never
    followed, so nothing outside the run is deleted."""
    if keep < 1:
        raise ValueError(f"keep (trainer.save_total_limit) must be >= 1, got {keep}")
    root = checkpoint_root(output_dir)
    run_files.refuse_link(root, "the run's checkpoints folder")
    if not root.is_dir():
        return []
    steps = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name))), reverse=True)
    old = [p for _, p in steps[keep:]]
    for p in old:
        run_files.remove(p)
    return old


_PARTIAL = re.compile(r"^step_\d+\.tmp$")


def clean_partial(output_dir: str) -> None:
    """Removes the leftovers of a write that was killed: ``step_N.tmp`` entries of ``checkpoints/``,
    and nothing else (a link by such a name is unlinked, never followed)."""
    root = checkpoint_root(output_dir)
    run_files.refuse_link(root, "the run's checkpoints folder")
    if root.is_dir():
        for p in root.iterdir():
            if _PARTIAL.match(p.name):
                run_files.remove(p)


# ----------------------------------------------------------------------------- verifying and loading


def verify(path: Path) -> Optional[str]:
    """None when ``path`` holds exactly the files its manifest lists, each a regular file with the
    size and checksum recorded; else what is wrong, naming the file. Only regular files inside
    ``path`` are read: a manifest naming anything else (an absolute path, ``..``, a symbolic link,
    a device) or malformed in any way is itself the problem found."""
    if path.is_symlink():
        return f"{path} is a symbolic link (to {os.readlink(path)}); a checkpoint must lie inside the run folder"
    manifest = path / MANIFEST
    if not manifest.is_file() or manifest.is_symlink():
        return f"{manifest} is missing (the write did not finish)"
    files, problem = _manifest_files(manifest)
    if problem is None:
        on_disk, problem = _regular_files(path)
    if problem is None:
        problem = _listed_as_found(path, files, on_disk)
    if problem is not None:
        return problem
    names = sorted(files)
    found = _checksums(path, names)
    for name in names:
        want, got = files[name], found[name]
        if "error" in got:
            return f"{path / name}: {got['error']}"
        if got["bytes"] != want["bytes"]:
            how = "empty" if got["bytes"] == 0 else "truncated" if got["bytes"] < want["bytes"] else "too long"
            return f"{path / name} is {got['bytes']:,} bytes, the manifest says {want['bytes']:,} ({how})"
        if got["crc32"] != want["crc32"]:
            return f"{path / name} does not match its checksum in the manifest (corrupt)"
    return _state_problem(path)


_MAX_STATE_BYTES = 256 << 20


def _state_problem(path: Path) -> Optional[str]:
    """What is wrong with the trainer state of the checkpoint ``path`` (None: nothing): a JSON object
    whose ``step`` is the folder's own step number and whose ``history`` is a list of metric rows."""
    state_file = path / STATE
    if not state_file.is_file() or state_file.is_symlink():
        return f"{state_file} is missing or not a regular file"
    if state_file.stat().st_size > _MAX_STATE_BYTES:
        return f"{state_file} is larger than {_MAX_STATE_BYTES >> 20} MiB"
    try:
        state = json.loads(state_file.read_bytes())
    except (ValueError, RecursionError) as e:
        return f"{state_file} is not JSON ({' '.join(str(e).split())[:200]})"
    if not isinstance(state, dict):
        return f"{state_file} must hold a JSON object, got {type(state).__name__}"
    step, named = state.get("step"), _STEP.match(path.name)
    if not _count(step) or (named is not None and step != int(named.group(1))):
        want = f"{int(named.group(1))}, the folder's step" if named else "a step count (an integer >= 0)"
        return f"{state_file}: step must be {want}, got {step!r:.40}"
    history = state.get("history", [])
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        return f"{state_file}: history must be a list of metric rows, got {type(history).__name__}"
    return None


# what every checkpoint's manifest lists: the trainer state, and the sharded weights' DCP metadata
# (``dcp/``, or ``megatron/`` for a Megatron-trained actor: strategies/megatron/run_checkpoint.py)
_REQUIRED = (STATE,)
_WEIGHTS_METADATA = (f"{DCP}/.metadata", "megatron/.metadata")


def _manifest_files(manifest: Path):
    """``(files, None)``: the manifest's file -> {bytes, crc32} records, each name a plain relative
    path; ``(None, problem)`` when it is not that."""
    try:
        data = json.loads(manifest.read_bytes())
    except (OSError, ValueError) as e:
        return None, f"{manifest} is not readable JSON ({e})"
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return None, (f"{manifest}: 'files' must map each file to its size and CRC-32, got "
                      f"{type(files).__name__}")
    for name, record in files.items():
        if not _inside(name):
            return None, f"{manifest} lists {name!r}, which is not a path inside the checkpoint folder"
        if not (isinstance(record, dict) and all(_count(record.get(k)) for k in ("bytes", "crc32"))):
            return None, f"{manifest}: the entry of {name} must be {{\"bytes\": size, \"crc32\": checksum}}, got {record!r}"
    missing = [n for n in _REQUIRED if n not in files]
    if not any(n in files for n in _WEIGHTS_METADATA):
        missing.append(" or ".join(_WEIGHTS_METADATA))
    if missing:
        return None, f"{manifest} does not list {missing[0]}"
    return files, None


def _inside(name: Any) -> bool:
    """A plain relative path: no absolute path, no ``.`` / ``..`` / empty part, nothing to normalise."""
    return (isinstance(name, str) and bool(name) and "\0" not in name and not os.path.isabs(name)
            and os.path.normpath(name) == name and all(part not in ("", ".", "..") for part in name.split("/")))


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _regular_files(folder: Path):
    """``(names, None)``: every file under ``folder`` (relative names), walked without following a
    symbolic link; ``(None, problem)`` when it holds a link, a device, a FIFO or a socket."""
    names: List[str] = []
    pending = [folder]
    while pending:
        current = pending.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                if entry.is_symlink():
                    return None, (f"{entry.path} is a symbolic link (to {os.readlink(entry.path)}); a checkpoint "
                                  "reads only files inside its folder")
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    names.append(os.path.relpath(entry.path, folder))
                else:
                    return None, f"{entry.path} is not a regular file (a device, FIFO or socket)"
    return names, None


def _listed_as_found(path: Path, files: Dict[str, Any], on_disk: List[str]) -> Optional[str]:
    """The files on disk and those in the manifest must be the same (a file it does not list is
    unchecked, and may be the damaged one)."""
    missing = sorted(set(files) - set(on_disk))
    if missing:
        return f"{path / missing[0]} is missing (the manifest lists it)"
    unlisted = sorted(set(on_disk) - set(files) - {MANIFEST})
    if unlisted:
        return f"{path / unlisted[0]} is not in the manifest (its contents are unchecked)"
    return None


def _warn(message: str) -> None:
    if rank_world()[0] == 0:
        print(message, file=sys.stderr, flush=True)


def latest_valid(output_dir: str, warn: Callable[[str], None] = _warn) -> Optional[Path]:
    """The newest checkpoint that passes ``verify``; each damaged newer one is named, with what is
    wrong and the checkpoint resumed instead ("checkpoint step_N is damaged: ...; resuming from ...")."""
    bad: List[str] = []
    for path in step_dirs(output_dir):
        problem = verify(path)
        if problem is None:
            for message in bad:
                warn(f"{message}; resuming from {path.name}")
            return path
        bad.append(f"checkpoint {path.name} is damaged: {problem}")
    for message in bad:
        warn(f"{message}; no complete checkpoint is left in {checkpoint_root(output_dir)}: starting from the "
             "initial weights")
    return None


def _dcp_cause(error: BaseException) -> str:
    """The first line of what failed inside DCP (its CheckpointException holds each rank's exception
    with its traceback flattened into the text)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (the exception, its frames)
        error = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else first
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:300]


def load(path: Path, actor: torch.nn.Module, optimizer: torch.optim.Optimizer,
         critic: Optional[torch.nn.Module] = None,
         critic_optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
    """Restores weights and optimizer states in place, resharded to this run's layout (any number of
    processes, sharded or not); returns the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    _, world = rank_world()
    reader = safe_load.dcp_reader(path / DCP)
    # read first, as data only: a refused pickle is named as such, not as a checkpoint that does not fit
    keys = reader.read_metadata().state_dict_metadata
    if critic is not None and not any(k.startswith("critic.") for k in keys):
        critic_optimizer, critic = None, None  # a checkpoint of a run without a critic
    shards = _state(actor, optimizer, critic, critic_optimizer)
    try:
        with _quiet():
            dcp.load(shards, storage_reader=reader, planner=safe_load.dcp_planner(),
                     no_dist=world == 1)  # data only: nothing in the files runs
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} does not fit this run's models: {_dcp_cause(e)} (saved by a run "
                              "of another model, LoRA setting or optimizer?)") from e
    set_model_state_dict(actor, shards["actor"])
    set_optimizer_state_dict(actor, optimizer, shards["actor_optim"])
    if critic is not None:
        set_model_state_dict(critic, shards["critic"])
        if critic_optimizer is not None and "critic_optim" in shards:
            set_optimizer_state_dict(critic, critic_optimizer, shards["critic_optim"])
    return json.loads((path / STATE).read_text())


# ----------------------------------------------------------------------------- HF export


def _write_safetensors(dcp_dir: Path, out: Path, max_shard_bytes: int = 5 << 30,
                       whole: Optional[Dict[str, torch.Tensor]] = None) -> Records:
    """The actor's weights from ``dcp_dir`` as HF safetensors in ``out``, read a shard's worth at a
    time (memory stays under ``max_shard_bytes`` whatever the model's size); returns the weight
    files' records. ``whole``: the actor's state dict as DCP saved it, whole tensors in this process:
    written from memory instead."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if whole is not None:
        tensors = {f"actor.{k}": (v.shape, v.dtype) for k, v in sorted(whole.items()) if isinstance(v, torch.Tensor)}
    else:
        meta = safe_load.dcp_reader(dcp_dir).read_metadata().state_dict_metadata
        tensors = {k: (m.size, m.properties.dtype) for k, m in sorted(meta.items())
                   if k.startswith("actor.") and isinstance(m, TensorStorageMetadata)}
    if not tensors:
        raise CheckpointError(f"{dcp_dir} holds no actor weights")
    # export name -> the "actor.*" tensors it is made of (a LoRA actor's adapters merged into its weights)
    adapter_file = out / lora.ADAPTER / "adapter_config.json"
    adapter = json.loads(adapter_file.read_text()) if adapter_file.is_file() else None
    if adapter is None:
        plan = {k[len("actor."):]: (k,) for k in tensors}
    else:
        try:
            plan = {name: tuple(f"actor.{src}" for src in sources) for name, sources in
                    lora.export_plan([k[len("actor."):] for k in tensors], adapter).items()}
        except ValueError as e:
            raise CheckpointError(f"{dcp_dir}: {e}") from None
    config = out / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings"):
        plan.pop("lm_head.weight", None)  # transformers ties it to the input embeddings
    groups: List[List[str]] = [[]]
    size = 0
    for k, sources in plan.items():
        shape, dtype = tensors[sources[0]]
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map: Dict[str, str] = {}
    written: Records = {}
    for name, keys in zip(names, groups):
        needed = sorted({src for k in keys for src in plan[k]})
        if whole is not None:
            part = {k: whole[k[len("actor."):]].detach().cpu().contiguous() for k in needed}
        else:
            part = {k: torch.empty(tensors[k][0], dtype=tensors[k][1]) for k in needed}
            with _quiet():
                dcp.load(part, storage_reader=safe_load.dcp_reader(dcp_dir), planner=safe_load.dcp_planner(),
                         no_dist=True)
        out_tensors = {k: lora.exported(plan[k], part, adapter) if adapter else part[plan[k][0]] for k in keys}
        written[str(out / name)] = direct_write.write_safetensors(out / name, out_tensors, metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    if len(names) > 1:
        total = sum(tensors[plan[k][0]][0].numel() * torch.empty((), dtype=tensors[plan[k][0]][1]).element_size()
                    for k in plan)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return written


def resolve(checkpoint: str) -> Path:
    """A step folder as it is, or an output_dir / checkpoints folder: its newest complete checkpoint."""
    path = Path(checkpoint)
    if (path / DCP).is_dir():
        return path
    output_dir = path.parent if path.name == "checkpoints" else path
    found = latest_valid(str(output_dir))
    if found is None:
        raise CheckpointError(f"{checkpoint}: no complete checkpoint there (expected a step_N folder with "
                              f"{DCP}/ and {MANIFEST}, or a run's output_dir)")
    return found


def resolve_start(resume_from: str, output_dir: str, check_files: bool = True) -> Path:
    """The checkpoint ``trainer.resume_from`` names (a step folder, or a run's output_dir: its newest
    complete one), verified (``check_files``: every file against the manifest; else only that it is
    a checkpoint). Refused when ``output_dir`` holds a newer checkpoint than it, whose steps the new
    run would mix with its own."""
    try:
        path = resolve(resume_from)
    except CheckpointError as e:
        raise CheckpointError(f"trainer.resume_from={resume_from}: {e}") from None
    problem = verify(path) if check_files else (_state_problem(path) if (path / MANIFEST).is_file() else
                                                 f"{path / MANIFEST} is missing (not a complete checkpoint)")
    if problem is not None:
        raise CheckpointError(f"trainer.resume_from={resume_from}: {problem}")
    step = int(json.loads((path / STATE).read_text())["step"])
    newer = [p for p in step_dirs(output_dir) if int(_STEP.match(p.name).group(1)) > step and p != path]
    if newer:
        raise CheckpointError(f"trainer.resume_from={resume_from} is step {step}, but trainer.output_dir holds the "
                              f"newer checkpoint {newer[0]}: the runs' steps would mix; choose another output_dir, "
                              "or remove the newer checkpoints")
    return path


def not_exported(folder: Path) -> List[str]:
    """Patterns of what a checkpoint folder holds beside its HF export (the sharded state, the
    trainer state, the manifest): what an upload of the export leaves out."""
    return sorted(f"{p.name}/*" if p.is_dir() else p.name for p in folder.iterdir()
                  if p.name in _NOT_HF or p.is_dir())


def export(checkpoint: str, out_dir: str, max_shard_bytes: int = 5 << 30, overwrite: bool = False) -> Path:
    """Writes the HF folder (config, tokenizer, safetensors) of ``checkpoint`` to ``out_dir``, which
    may not be the run or lie inside it; a folder holding files is refused unless ``overwrite``
    (which replaces only the files an export writes). Written under a unique temporary name beside
    ``out_dir``, then renamed (``verl_fast.files.output_folder``)."""
    src = resolve(checkpoint)
    run = src.parent.parent if src.parent.name == "checkpoints" else src
    out = Path(out_dir)
    output_folder.check_target(out, run, overwrite, "the export")  # before any work
    problem = verify(src)
    if problem is not None:
        raise CheckpointError(f"cannot export {src}: {problem}")

    def fill(tmp: Path) -> None:
        for p in src.iterdir():
            if p.name not in _NOT_HF and p.is_file() and not is_weights(p.name):
                shutil.copy2(p, tmp / p.name)
        if (src / lora.ADAPTER).is_dir():  # a LoRA actor's adapter, beside the merged weights
            shutil.copytree(src / lora.ADAPTER, tmp / lora.ADAPTER)
        if not (tmp / model_card.CARD).is_file():  # a checkpoint written without its export
            model_card.write(tmp, json.loads((src / STATE).read_text()))
        _write_safetensors(src / DCP, tmp, max_shard_bytes)
        _fsync_tree(tmp)

    try:
        return output_folder.write_folder(out, run, fill, overwrite=overwrite, what="the export", stale=is_weights)
    except Exception as e:
        if not _is_disk_full(e):
            raise
        from verl_fast.errors import human_bytes

        where = out.resolve()
        while not where.is_dir() and where != where.parent:  # the nearest folder there is
            where = where.parent
        raise CheckpointError(f"no space left on the disk of {out} ({human_bytes(shutil.disk_usage(where).free)} "
                              f"free) for the export of {src}: nothing was written there; free space or export "
                              "elsewhere") from e


def is_weights(name: str) -> bool:
    """An HF export's weight files (an older export's shards are stale beside new ones)."""
    return (name.startswith("model") and name.endswith(".safetensors")) or name == "model.safetensors.index.json"
