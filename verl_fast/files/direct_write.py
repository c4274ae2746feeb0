"""Checkpoint files written straight to the disk (``O_DIRECT``), each file's size and CRC-32 taken on
the way.

Why: a buffered write first fills fresh page-cache pages, and on virtual machines whose memory the
host backs lazily (the 2-core development machine is one) every fresh 4 KiB page faults in from the
host, several times slower than ``O_DIRECT`` from one aligned buffer (docs/benchmarks.md). A checkpoint is written once and read rarely, so leaving it out of the cache costs
nothing later, and the CRC the manifest records needs no second pass over the files. Where the file
system refuses ``O_DIRECT`` (tmpfs, some network file systems) the same writer writes buffered.

- ``DirectWriter``: a write-only binary stream (what ``torch.save`` and DCP write to).
- ``DirectFileSystem``: DCP's file system with that stream for the files it writes.
- ``write_safetensors``: a safetensors file streamed through it (no copy of the tensors' bytes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import zlib
from pathlib import Path
from typing import Dict, Iterator, Mapping, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

BLOCK = 4096  # O_DIRECT's alignment of addresses, offsets and lengths (512-byte devices included)
BUFFER = 16 << 20  # bytes gathered before each write (a multiple of BLOCK)

Records = Dict[str, Tuple[int, int]]  # path -> (bytes, CRC-32) of the files written


class DirectWriter:
    """``open(path, "wb")`` for large sequential writes, through a page-aligned buffer; ``size`` and
    ``crc32`` are those of everything written. ``close()`` writes the last partial block padded,
    then cuts the file to its size."""

    def __init__(self, path: os.PathLike):
        self.path = str(path)
        self.size = 0
        self.crc32 = 0
        self.closed = False
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW  # never write through a link
        self._direct = hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(self.path, flags | (os.O_DIRECT if self._direct else 0), 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False
            self._fd = os.open(self.path, flags, 0o644)
        self._buffer = mmap.mmap(-1, BUFFER)  # page-aligned
        self._view = memoryview(self._buffer)
        self._used = 0

    def write(self, data) -> int:
        src = memoryview(data).cast("B")
        self.crc32 = zlib.crc32(src, self.crc32)
        self.size += len(src)
        done = 0
        while done < len(src):
            take = min(BUFFER - self._used, len(src) - done)
            self._view[self._used : self._used + take] = src[done : done + take]
            self._used += take
            done += take
            if self._used == BUFFER:
                self._drain(BUFFER)
        return len(src)

    def _drain(self, n: int) -> None:
        """Writes the buffer's first ``n`` bytes (a multiple of BLOCK when direct)."""
        done = 0
        while done < n:
            try:
                done += os.write(self._fd, self._view[done:n])
            except OSError as e:  # the file system took O_DIRECT at open but not for writing
                if not self._direct or e.errno != errno.EINVAL:
                    raise
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self._direct = False
        self._used = 0

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        """Nothing: the buffer goes out in whole blocks, the last one at ``close()``."""

    def fileno(self) -> int:
        return self._fd

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._used:
                tail = self._used
                if self._direct:
                    padded = -(-tail // BLOCK) * BLOCK
                    self._view[tail:padded] = bytes(padded - tail)
                    self._drain(padded)
                    os.ftruncate(self._fd, self.size)
                else:
                    self._drain(tail)
        finally:
            os.close(self._fd)
            self._view.release()
            self._buffer.close()

    def __enter__(self) -> "DirectWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DirectFileSystem(FileSystem):
    """DCP's local file system, writing its files with ``DirectWriter``; ``records`` maps each file
    written (by its final name) to its size and CRC-32."""

    def __init__(self) -> None:
        super().__init__()
        self.records: Records = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        writer = DirectWriter(path)
        try:
            yield writer
        finally:
            writer.close()
        self.records[str(path)] = (writer.size, writer.crc32)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        if str(path) in self.records:
            self.records[str(new_path)] = self.records.pop(str(path))


def dcp_writer(path: os.PathLike):
    """DCP's ``FileSystemWriter`` for ``path`` writing through ``DirectFileSystem`` (its ``fs``, whose
    ``records`` list the files). A torch whose writer keeps no ``fs`` writes buffered, unrecorded."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(path))
    writer.fs = DirectFileSystem()
    return writer


# safetensors' names of the dtypes a model holds
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: os.PathLike, tensors: Mapping[str, torch.Tensor],
                      metadata: Optional[Dict[str, str]] = None) -> Tuple[int, int]:
    """Writes ``tensors`` (CPU) as a safetensors file: the 8-byte header length, the JSON header
    (padded with spaces to 8 bytes), then each tensor's bytes, widest dtypes first so that every
    tensor starts aligned to its element size. Returns the file's (bytes, CRC-32)."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: Dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for k in order:
        t = tensors[k]
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"write_safetensors: {k!r} has dtype {t.dtype}, which safetensors does not store")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with DirectWriter(Path(path)) as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for k in order:
            t = tensors[k].detach().contiguous()
            if t.numel():
                out.write(t.view(-1).view(torch.uint8).numpy())
    return out.size, out.crc32
