"""Loading files from outside the process (checkpoints, datasets) as data only.

``load``: ``torch.load(weights_only=True)``: tensors, plain containers, numbers and strings, plus the
globals a caller allowlists for its format. ``dcp_reader`` / ``dcp_planner``: torch DCP checkpoints,
whose ``.metadata`` is unpickled with an allowlist of DCP's own types and whose non-tensor items
with ``weights_only=True``. ``check_dcp_data``: the same reads over a DCP folder that another
loader (megatron-core's) then unpickles without an allowlist.

Every global a pickle names resolves through a table of exact objects, keyed by the full name as the
pickle spells it: never an import of the module it names followed by an attribute walk, so a module
on the list does not vouch for what it imports (``torch.distributed.checkpoint.metadata`` +
``os.system``), and a dotted name (pickle protocol 4's STACK_GLOBAL) reaches nothing unlisted.
Anything else in a pickle (a class to build, a function to call) is refused with a ValueError that
names the file (or item) and the global; nothing stored in a file ever runs.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import pickletools
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch


def load(path: "str | os.PathLike", safe_globals: Sequence[Any] = (), what: str = "a torch checkpoint") -> Any:
    """The object saved in ``path`` (on the CPU). ``safe_globals``: torch's allowlist entries (a
    callable, or a ``(callable, "module.name")`` pair when the pickle names it differently); torch
    looks each global up by its full name in that list, so it resolves to exactly the listed object."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _refused_globals(e, lambda: _torch_pickle(path))
        if refused is None:  # not a global: a damaged file or one torch.save did not write
            raise ValueError(f"{path}: not a readable torch file ({_reason(e)})") from None
        raise ValueError(f"{path}: refused to unpickle {refused}: {what} is loaded as data "
                         "only (tensors, containers, numbers, strings and its format's allowlist), never as code") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable torch file ({type(e).__name__}: {e})") from None


def _refused_globals(e: pickle.UnpicklingError, pickle_bytes: Callable[[], bytes]) -> Optional[str]:
    """What torch's weights-only unpickler refused: "the global module.name" its message names (a
    GLOBAL outside the allowlist), or, where it stopped at an opcode of pickle protocol 4+ (which
    torch.save never writes: STACK_GLOBAL and the strings before it), the globals the pickle names."""
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    if found is not None:
        return f"the global {found.group(1)}"
    if "Unsupported operand" not in str(e):
        return None
    try:
        names = list(dict.fromkeys(referenced_globals(pickle_bytes())))
    except (OSError, ValueError, zipfile.BadZipFile):
        return None
    if not names:
        return None
    return (f"the global{'s' if len(names) > 1 else ''} {', '.join(names)} (in a pickle of protocol 4 or more, "
            "which torch.save does not write)")


def _torch_pickle(path: "str | os.PathLike | io.BytesIO") -> bytes:
    """The pickle inside a torch file: the zip archive's top-level ``data.pkl``, else the file itself
    (torch's legacy format starts with pickles)."""
    if isinstance(path, io.BytesIO):
        path.seek(0)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            member = min((n for n in z.namelist() if n.endswith("data.pkl")), key=len, default=None)
            return z.read(member) if member is not None else b""
    if isinstance(path, io.BytesIO):
        return path.getvalue()
    with open(path, "rb") as f:
        return f.read()


_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}


def referenced_globals(data: bytes) -> List[str]:
    """The globals a pickle refers to, as "module.name", in order: GLOBAL's operands, and the two
    strings STACK_GLOBAL takes (followed through the memo). For messages: what is refused is decided
    by the unpickler, which resolves every name itself."""
    names: List[str] = []
    strings: List[Optional[str]] = []  # values pushed by string and memo-get opcodes, in order
    memo: Dict[int, Optional[str]] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _STRING_OPS:
                strings.append(arg if isinstance(arg, str) else arg.decode("latin-1"))
            elif op.name == "MEMOIZE":
                memo[len(memo)] = strings[-1] if strings else None
            elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = strings[-1] if strings else None
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                strings.append(memo.get(int(arg)))
            elif op.name in ("GLOBAL", "INST"):
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
    except ValueError:  # a damaged pickle: what was read so far
        pass
    return names


def _reason(e: Exception) -> str:
    """The specific line of torch's weights_only error (its other lines are general advice)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation", "WeightsUnpickler error")
    specific = [ln for ln in lines if not ln.startswith(advice)]
    return specific[0] if specific else type(e).__name__


# ---- torch DCP checkpoints (torch's FileSystemReader unpickles `.metadata` with no allowlist, and
# its default load planner unpickles non-tensor items with weights_only=False) ----------------------

_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
# plans that savers (megatron-core's among them) keep in the metadata: dataclasses and enums
_DCP_PLANS = ("SavePlan", "LoadPlan", "WriteItem", "ReadItem", "TensorWriteData", "WriteItemType", "LoadItemType")
_DCP_TYPES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
              "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")


@functools.lru_cache(maxsize=None)
def _dcp_metadata_objects() -> Dict[Tuple[str, str], Any]:
    """(module, name) -> the one object a DCP ``.metadata`` pickle may name there: DCP's metadata and
    plan types, its storage record, torch.Size, torch's dtypes / layouts / memory formats, paths,
    OrderedDict. Names are looked up as they stand: a dotted name (``os.system`` in a module that
    imports os) or any other attribute of these modules is not in the table."""
    import collections
    import pathlib

    import torch.distributed.checkpoint.filesystem as filesystem
    import torch.distributed.checkpoint.metadata as metadata
    import torch.distributed.checkpoint.planner as planner

    listed = ((metadata, _DCP_TYPES), (planner, _DCP_PLANS), (filesystem, ("_StorageInfo",)), (torch, ("Size",)),
              (torch.serialization, ("_get_layout",)), (collections, ("OrderedDict",)), (pathlib, _PATHS))
    table = {(module.__name__, name): getattr(module, name) for module, names in listed for name in names
             if hasattr(module, name)}
    table.update({(cls.__module__, cls.__name__): cls for cls in (getattr(pathlib, n) for n in _PATHS)})
    table.update({("torch", name): value for name, value in vars(torch).items()
                  if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))})
    return table


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        """The listed object itself: never an import or attribute walk of what the pickle names."""
        found = _dcp_metadata_objects().get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not a DCP metadata type")
        return found


def read_dcp_metadata(path: "str | os.PathLike") -> Any:
    """A DCP ``.metadata`` file's object, unpickled with an allowlist of DCP's own types."""
    try:
        with open(path, "rb") as f:
            return _DcpMetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: refused to unpickle {str(e).split(' is not', 1)[0].replace('GLOBAL', 'the global')}"
                         ": checkpoint metadata is loaded as data only, never as code") from None
    except (EOFError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not readable DCP metadata ({type(e).__name__}: {e})") from None


@functools.lru_cache(maxsize=None)
def _dcp_classes():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint._traverse import set_element

    class DataOnlyReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class DataOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                found = _refused_globals(e, lambda: _torch_pickle(value))
                raise ValueError(f"checkpoint item {fqn}: refused to unpickle "
                                 f"{found or 'an object outside the allowlist'}"
                                 ": checkpoints are loaded as data only, never as code") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return DataOnlyReader, DataOnlyPlanner


def dcp_reader(path: "str | os.PathLike"):
    """A torch DCP FileSystemReader for ``path`` whose metadata is read with an allowlist."""
    return _dcp_classes()[0](os.fspath(path))


def dcp_planner():
    """torch DCP's default load planner, with non-tensor items unpickled weights_only=True."""
    return _dcp_classes()[1]()


def check_dcp_data(path: "str | os.PathLike", safe_globals: Sequence[Any] = (), what: str = "a checkpoint") -> None:
    """Reads, as data only, everything in the DCP folder ``path`` that a loader without an allowlist
    (megatron-core's ``dist_checkpointing.load``: torch's plain FileSystemReader and its planner's
    ``weights_only=False`` items) would unpickle: ``.metadata``, every non-tensor item, and every
    ``.pt`` file (megatron-core's common state and sharded objects, with ``safe_globals``). Raises
    the ValueError naming the file or item and the global; once it passes, those pickles name only
    listed objects, so the other loader builds nothing else from them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = dcp_reader(path)
    items = {k: None for k, m in reader.read_metadata().state_dict_metadata.items()
             if isinstance(m, BytesStorageMetadata)}
    if items:
        with warnings.catch_warnings():  # DCP's note that it assumes one process, which is meant
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            try:
                dcp.load(items, storage_reader=reader, planner=dcp_planner(), no_dist=True)
            except BaseException as e:  # DCP's CheckpointException (a BaseException) wraps the refusal
                refusal = _wrapped_value_error(e)
                if refusal is None:
                    raise
                raise refusal from None
    for file in sorted(Path(path).rglob("*.pt")):
        load(file, safe_globals, what)


def _wrapped_value_error(e: BaseException) -> Optional[ValueError]:
    """The ValueError inside DCP's CheckpointException (``failures``: rank -> (exception, traceback))."""
    if isinstance(e, ValueError):
        return e
    for failure in getattr(e, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, ValueError):
            return inner
    return None
