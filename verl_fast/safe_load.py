"""Loading files from outside the process (checkpoints, datasets) as data only.

``load``: ``torch.load(weights_only=True)``: tensors, plain containers, numbers and strings, plus the
globals a caller allowlists for its format. ``dcp_reader`` / ``dcp_planner``: torch DCP checkpoints,
whose ``.metadata`` is unpickled with an allowlist of DCP's own types and whose non-tensor items
with ``weights_only=True``. Anything else in a pickle (a class to build, a function to call, such
as ``os.system``) is refused with a ValueError that names the file (or item) and the global;
nothing stored in a file ever runs.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import zipfile
from typing import Any, Sequence

import torch


def load(path: "str | os.PathLike", safe_globals: Sequence[Any] = (), what: str = "a torch checkpoint") -> Any:
    """The object saved in ``path`` (on the CPU). ``safe_globals``: torch's allowlist entries (a
    callable, or a ``(callable, "module.name")`` pair when the pickle names it differently)."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found is None:  # not a global: a damaged file or one torch.save did not write
            raise ValueError(f"{path}: not a readable torch file ({_reason(e)})") from None
        raise ValueError(f"{path}: refused to unpickle the global {found.group(1)}: {what} is loaded as data "
                         "only (tensors, containers, numbers, strings and its format's allowlist), never as code") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable torch file ({type(e).__name__}: {e})") from None


def _reason(e: Exception) -> str:
    """The specific line of torch's weights_only error (its other lines are general advice)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation", "WeightsUnpickler error")
    specific = [ln for ln in lines if not ln.startswith(advice)]
    return specific[0] if specific else type(e).__name__


# ---- torch DCP checkpoints (torch's FileSystemReader unpickles `.metadata` with no allowlist, and
# its default load planner unpickles non-tensor items with weights_only=False) ----------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
# plans that savers (megatron-core's among them) keep in the metadata: dataclasses and enums
_DCP_PLANS = ("SavePlan", "LoadPlan", "WriteItem", "ReadItem", "TensorWriteData", "WriteItemType", "LoadItemType")


def _dcp_metadata_global(module: str, name: str) -> bool:
    """DCP's metadata types, torch's sizes / dtypes / layouts / memory formats, paths, OrderedDict."""
    if module == _DCP_METADATA or (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                                      ("torch", "Size"), ("torch._utils", "_get_layout"),
                                                      ("torch.serialization", "_get_layout"),
                                                      ("collections", "OrderedDict")}:
        return True
    if module == "torch.distributed.checkpoint.planner":
        return name in _DCP_PLANS
    if module == "torch":
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
    return module == "pathlib" and name in _PATHS


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _dcp_metadata_global(module, name):
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not a DCP metadata type")
        return super().find_class(module, name)


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
                found = re.search(r"GLOBAL ([\w.]+)", str(e))
                raise ValueError(f"checkpoint item {fqn}: refused to unpickle "
                                 f"{'the global ' + found.group(1) if found else 'an object outside the allowlist'}"
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
