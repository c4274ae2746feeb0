"""direct_write: what DirectWriter writes (O_DIRECT, and buffered where the file system or the
platform has no O_DIRECT) is byte for byte what was given, with its size and CRC-32; the
safetensors files it streams load in the safetensors library as the tensors given."""

import os
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from verl_fast.files import direct_write
from verl_fast.files.direct_write import BLOCK, BUFFER, DirectWriter, write_safetensors

SIZES = [0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, BUFFER - 1, BUFFER, BUFFER + BLOCK + 3]


def write_chunks(path, chunks):
    with DirectWriter(path) as w:
        for c in chunks:
            assert w.write(c) == len(c)
        assert w.tell() == sum(map(len, chunks))
    return w


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_the_file_is_what_was_written(tmp_path, monkeypatch, direct):
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes() for n in SIZES]
    chunks.append(memoryview(bytearray(b"tail")))  # any bytes-like
    w = write_chunks(tmp_path / "f.bin", chunks)
    want = b"".join(bytes(c) for c in chunks)
    assert (tmp_path / "f.bin").read_bytes() == want
    assert (w.size, w.crc32) == (len(want), zlib.crc32(want))
    w.close()  # a second close does nothing


def test_a_file_system_without_o_direct_is_written_buffered():
    if not hasattr(os, "O_DIRECT") or not os.path.isdir("/dev/shm"):
        pytest.skip("needs Linux's /dev/shm (tmpfs refuses O_DIRECT)")
    path = f"/dev/shm/vf_direct_write_{os.getpid()}.bin"
    try:
        data = bytes(range(256)) * 100
        w = write_chunks(path, [data[:5], data[5:]])
        assert open(path, "rb").read() == data and w.crc32 == zlib.crc32(data)
    finally:
        os.remove(path)


def test_safetensors_streamed_load_as_given(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "w64": torch.randn(3, 5, dtype=torch.float64, generator=g),
        "w32": torch.randn(7, generator=g),
        "h16": torch.randn(2, 3, generator=g).half(),
        "b16": torch.randn(4, 1, 3, generator=g).bfloat16(),
        "i64": torch.randint(-9, 9, (5,), generator=g),
        "i32": torch.randint(-9, 9, (2, 2), generator=g, dtype=torch.int32),
        "i16": torch.randint(-9, 9, (3,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-9, 9, (3,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # written contiguous
    }
    size, crc = write_safetensors(tmp_path / "m.safetensors", tensors, metadata={"format": "pt"})
    raw = (tmp_path / "m.safetensors").read_bytes()
    assert (size, crc) == (len(raw), zlib.crc32(raw))
    got = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(TypeError, match="'c'.*complex64"):
        write_safetensors(tmp_path / "bad.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})


def test_dcp_files_are_recorded_under_their_final_names(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.randn(1000), "b": torch.arange(10)}
    writer = direct_write.dcp_writer(tmp_path / "dcp")
    dcp.save(state, storage_writer=writer, no_dist=True)
    files = {str(p) for p in (tmp_path / "dcp").iterdir()}
    assert set(writer.fs.records) == files  # the .metadata renamed from its temporary name included
    for path, (size, crc) in writer.fs.records.items():
        data = open(path, "rb").read()
        assert (size, crc) == (len(data), zlib.crc32(data)), path
    back = {"a": torch.empty(1000), "b": torch.empty(10, dtype=torch.int64)}
    dcp.load(back, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state)
