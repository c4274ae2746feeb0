"""Lay out vLLM 0.26's wheel for the GPU machine in as few carried folders as the call's file limit allows.

The wheel (``../shared/tools/device_vllm/prepare.sh`` downloads it into ``.dvcache/``) is rewritten without what
an SM90 GPU never loads: FlashAttention 2's extension (vLLM picks FlashAttention 3 on Hopper and imports FA2
behind a guard), the Rust front-end binary (only run with ``VLLM_RUST_FRONTEND_PATH``) and DeepGEMM's bindings
for Pythons other than 3.12 (the GPU image's); the RECORD loses their lines. The result is split into
``.dvp0`` ... ``.dvpN`` (``vllm.part.K``, the wheel's name in ``.dvp0/WHEEL_NAME``), which
``benchmarks/gpu_run.sh`` joins on the machine.

    python scripts/vllm_pieces.py [--wheel .dvcache/vllm-0.26.0-...whl] [--piece-mb 54]
"""

from __future__ import annotations

import argparse
import glob
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path


def left_out(name: str) -> bool:
    return (name in ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")
            or (name.startswith("vllm/third_party/deep_gemm/_C.cpython-") and "cpython-312-" not in name))


def slim(wheel: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if left_out(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [line for line in data.decode().splitlines() if not left_out(line.split(",")[0])]
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data, compress_type=info.compress_type)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheel", help="vLLM's wheel (default: the one in .dvcache/)")
    p.add_argument("--piece-mb", type=float, default=54.0, help="a piece's size; the tree rides along under 64 MiB")
    args = p.parse_args(argv)
    wheels = [args.wheel] if args.wheel else glob.glob(".dvcache/vllm-*.whl")
    if len(wheels) != 1:
        raise SystemExit(f"--wheel: expected one vLLM wheel, found {wheels or 'none'} in .dvcache/")
    wheel = Path(wheels[0])
    piece = int(args.piece_mb * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        slimmed = Path(tmp) / wheel.name
        slim(wheel, slimmed)
        pieces = -(-slimmed.stat().st_size // piece)
        if pieces > 10:
            raise SystemExit(f"{pieces} pieces: gpu_run.sh joins vllm.part.0 .. vllm.part.9; raise --piece-mb")
        for old in glob.glob(".dvp*"):
            shutil.rmtree(old)
        with open(slimmed, "rb") as f:
            k = 0
            while chunk := f.read(piece):
                folder = Path(f".dvp{k}")
                folder.mkdir()
                (folder / f"vllm.part.{k}").write_bytes(chunk)
                k += 1
        Path(".dvp0/WHEEL_NAME").write_text(wheel.name + "\n")
        print(f"{wheel.name}: {wheel.stat().st_size / 1e6:.0f} MB -> {slimmed.stat().st_size / 1e6:.0f} MB "
              f"in {k} pieces (.dvp0 .. .dvp{k - 1})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
