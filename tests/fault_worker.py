"""The process side of tests/test_faults.py: loads damaged copies of a clean artifact and says
what happened, and writes checkpoints in a loop until it is killed.

``python fault_worker.py load KIND CLEAN [REF...]``: decodes CLEAN once (the reference), prints
``{"ready": true}``, then for each trial read from stdin (one JSON object a line: a file of the
artifact and a byte flip or a truncation) loads a damaged copy and prints one JSON line with the
outcome: ``clear`` (a DynaQuantError), ``other`` (any other exception), ``silent`` (it loaded
and differs from the reference) or ``unchanged`` (it loaded, identical). KIND is ``checkpoint``
(a store written by Compressor, loaded with ``read_checkpoint`` for every REF) or ``folder``
(a compress_folder output, loaded with ``decompress_folder``). A hang is seen by the test,
which reads each outcome with a timeout and kills this process.

``python fault_worker.py save STORE TAG [BASE_REF]``: trains a small model with AdamW and writes
a checkpoint (optimizer state compressed) after every step, printing ``writing REF`` before
and ``saved REF DIGEST`` once it is written and read back; it never stops on its own.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def digest(obj: Any) -> str:
    """SHA-256 of a nested structure of tensors and plain values, bit for bit."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous().cpu()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def load_checkpoints(root: Path, refs: list[str], scratch: Path) -> Any:
    from hf_dynaquant import CheckpointStore
    from hf_dynaquant.training.compressor import read_checkpoint

    store = CheckpointStore(root, create=False)
    return {ref: read_checkpoint(store, ref)[:2] for ref in refs}


def load_folder(root: Path, refs: list[str], scratch: Path) -> Any:
    from safetensors.torch import load_file

    from hf_dynaquant.pretrained.folder import decompress_folder

    out = decompress_folder(root, scratch / "plain", progress=False)
    return {p.name: load_file(p) for p in sorted(out.glob("*.safetensors"))}


def damage(path: Path, trial: dict[str, Any]) -> None:
    data = bytearray(path.read_bytes())
    if trial["op"] == "flip":
        data[trial["offset"]] ^= trial["mask"]
    else:
        del data[trial["length"] :]
    path.write_bytes(bytes(data))


def serve_loads(kind: str, clean: Path, refs: list[str]) -> None:
    from hf_dynaquant.errors import DynaQuantError

    load = {"checkpoint": load_checkpoints, "folder": load_folder}[kind]
    with tempfile.TemporaryDirectory() as tmp:
        reference = digest(load(clean, refs, Path(tmp)))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        trial = json.loads(line)
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "copy"
            shutil.copytree(clean, copy)
            damage(copy / trial["file"], trial)
            detail = ""
            try:
                got = digest(load(copy, refs, Path(tmp)))
            except DynaQuantError as exc:
                outcome, detail = "clear", f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - what the suite counts as a failure
                outcome, detail = "other", f"{type(exc).__name__}: {exc}"
            else:
                outcome = "unchanged" if got == reference else "silent"
        print(json.dumps({"outcome": outcome, "detail": detail[:400]}), flush=True)


def save_forever(store_path: Path, tag: str, base_ref: str | None) -> None:
    from hf_dynaquant import Compressor, QuantConfig
    from hf_dynaquant.training.compressor import read_checkpoint

    torch.manual_seed(len(tag))
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    comp = Compressor(model, store_path, QuantConfig(bins=16), optimizer=opt, optimizer_state="compress")
    if base_ref:
        comp.continue_chain(base_ref)
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        x = torch.randn(32, 128)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        comp.on_backward_pass_end()
        opt.step()
        comp.before_gradient_flush()
        opt.zero_grad()
        ref = f"{tag}-{step}"
        print(f"writing {ref}", flush=True)
        entry = comp.compress(step)
        comp.store.set_ref(ref, entry)
        print(f"saved {ref} {digest(read_checkpoint(comp.store, ref)[:2])}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "load":
        serve_loads(sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
    else:
        save_forever(Path(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
