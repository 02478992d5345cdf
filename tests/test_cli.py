"""The command line, end to end on the real all-MiniLM-L6-v2 folder."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dynaquant.cli import main
from hf_dynaquant.pretrained.calibration import PRETRAINED_BASE, PRETRAINED_SPACE
from hf_dynaquant.pretrained.folder import MODEL_REF, compress_folder, find_store


def test_cli_roundtrip_minilm(minilm_dir: Path, tmp_path: Path, capsys) -> None:
    from transformers import AutoModel

    packed, restored = tmp_path / "packed", tmp_path / "restored"
    assert main(["compress", str(minilm_dir), str(packed), "--quiet"]) == 0
    assert "1.2" in capsys.readouterr().out  # the ratio is reported
    assert (packed / "config.json").read_bytes() == (minilm_dir / "config.json").read_bytes()
    assert (packed / "1_Pooling" / "config.json").exists() and not (packed / "model.safetensors").exists()

    assert main(["inspect", str(packed)]) == 0
    table = capsys.readouterr().out
    assert "embeddings.word_embeddings.weight" in table and "F32" in table and "30522x384" in table
    assert "total" in table and "I64" in table

    assert main(["verify", str(packed), "--deep"]) == 0
    assert capsys.readouterr().out.startswith("OK")

    assert main(["decompress", str(packed), str(restored), "--quiet"]) == 0
    assert (restored / "tokenizer.json").exists() and not (restored / "dynaquant").exists()
    original = AutoModel.from_pretrained(str(minilm_dir)).state_dict()
    loaded = AutoModel.from_pretrained(str(restored)).state_dict()
    assert original.keys() == loaded.keys()
    for name in original:
        assert torch.equal(original[name], loaded[name]), name


def test_cli_single_file_and_errors(minilm_dir: Path, tmp_path: Path, capsys) -> None:
    src = tmp_path / "weights.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.randn(100, 10), "b": torch.arange(5)}, str(src), metadata={"format": "pt"})
    assert main(["compress", str(src), str(tmp_path / "out"), "--quiet"]) == 0
    assert main(["decompress", str(tmp_path / "out"), str(tmp_path / "back"), "--quiet"]) == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "back" / "weights.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and torch.equal(f.get_tensor("b"), torch.arange(5))
    capsys.readouterr()

    assert main(["compress", str(src), str(tmp_path / "out"), "--quiet"]) == 1  # exists
    assert "already exists" in capsys.readouterr().err

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"not really a pickle")
    assert main(["compress", str(pickled), str(tmp_path / "x"), "--quiet"]) == 1
    assert "never unpickles" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

    assert main(["verify", str(tmp_path)]) == 1
    assert "neither a compressed folder" in capsys.readouterr().err

    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "out", broken)
    victim = next((broken / "dynaquant" / "entries").glob("*/payload.safetensors"))
    victim.write_bytes(victim.read_bytes()[:-10])
    assert main(["verify", str(broken)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_console_script_help() -> None:
    exe = Path(sys.executable).parent / "hf-dynaquant"  # installed next to the interpreter running the tests
    assert exe.exists(), "the hf-dynaquant console script is missing: install the package (pip install -e .)"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("compress", "decompress", "inspect", "verify", "demo"):
        assert cmd in out


@pytest.mark.slow
def test_demo_runs(capsys) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact" in out and "verify --deep: OK" in out and "sentence-embedding cosine" in out


def test_cli_dynaquant_minilm(minilm_dir: Path, tmp_path: Path, capsys) -> None:
    from transformers import AutoModel, AutoTokenizer

    packed, restored = tmp_path / "packed", tmp_path / "restored"
    args = [
        "compress",
        str(minilm_dir),
        str(packed),
        "--codec",
        "dynaquant",
        "--bins",
        "16",
        "--prune",
        "0.05",
        "--protect",
        "0.005",
        "--prune-by",
        "sensitivity",
        "--quiet",
    ]
    with pytest.warns(UserWarning, match="magnitude"):  # no gradients for a saved model
        assert main(args) == 0
    assert main(["inspect", str(packed)]) == 0
    table = capsys.readouterr().out
    assert "dynaquant" in table and "lossless" in table  # weights quantized, biases and norms exact
    assert main(["decompress", str(packed), str(restored), "--quiet"]) == 0
    stored = sum(p.stat().st_size for p in (packed / "dynaquant").rglob("*") if p.is_file())
    assert (minilm_dir / "model.safetensors").stat().st_size / stored > 5

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    batch = tok(["Checkpoints are big.", "Quantization makes them small."], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = AutoModel.from_pretrained(str(minilm_dir))(**batch).last_hidden_state.mean(1)
        b = AutoModel.from_pretrained(str(restored))(**batch).last_hidden_state.mean(1)
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.9  # a fixed configuration; the search tunes it

    assert main(["compress", str(minilm_dir), str(tmp_path / "bad"), "--codec", "dynaquant", "--bins", "1"]) == 2
    assert "argument --bins: must be between 2 and 254" in capsys.readouterr().err


def tiny_bert_folder(minilm_dir: Path, dst: Path) -> Path:
    """A small BERT saved like a Hub model (config, safetensors, MiniLM's tokenizer)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, dst / name)
    return dst


def test_cli_threshold_searches_the_configuration(minilm_dir: Path, tmp_path: Path, capsys) -> None:
    src = tiny_bert_folder(minilm_dir, tmp_path / "tiny")
    out = tmp_path / "tiny-dq"
    # the pre-trained presets (PRETRAINED_SPACE, PRETRAINED_BASE), as compress_pretrained searches with them
    assert main(["compress", str(src), str(out), "--codec", "dynaquant", "--threshold", "0.4", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    table = capsys.readouterr().out
    assert "search: exhaustive" in table and "chosen bins=" in table
    with find_store(out).open(MODEL_REF) as entry:
        chosen = entry.metadata["quant_config"]
    assert chosen["sigma"] == PRETRAINED_BASE.sigma and chosen["embedding_bins"] in PRETRAINED_SPACE.embedding_bins
    python = compress_folder(src, tmp_path / "python", codec="dynaquant", threshold=0.4, progress=False)
    with find_store(python.path).open(MODEL_REF) as entry:
        assert entry.metadata["quant_config"] == chosen  # the same threshold searches alike from Python
    assert main(["compress", str(src), str(tmp_path / "x"), "--threshold", "0.05"]) == 1
    assert "add --codec dynaquant" in capsys.readouterr().err


def test_compress_folder_loads_the_model_once(minilm_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """With a threshold, the calibration (error feedback) and the search evaluate one loaded model."""
    from hf_dynaquant.pretrained import calibration, folder

    loads: list[Path] = []
    real = calibration.load_model

    def counted(path):
        loads.append(path)
        return real(path)

    monkeypatch.setattr(calibration, "load_model", counted)
    monkeypatch.setattr(folder, "load_model", counted)
    src = tiny_bert_folder(minilm_dir, tmp_path / "tiny")
    out = compress_folder(src, tmp_path / "out", codec="dynaquant", threshold=0.4, progress=False)
    assert loads == [src] and out.ratio > 1
    with find_store(out.path).open(MODEL_REF) as entry:
        assert entry.metadata["quant_config"]["error_feedback"]


def test_quant_options_need_the_dynaquant_codec(tmp_path: Path, capsys) -> None:
    src = tmp_path / "w.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.randn(100, 10)}, str(src))
    for option in (["--bins", "8"], ["--prune", "0.1"], ["--protect", "0.01"], ["--prune-by", "magnitude"]):
        assert main(["compress", str(src), str(tmp_path / "out"), "--quiet", *option]) == 1
        err = capsys.readouterr().err
        assert option[0] in err and "add --codec dynaquant" in err and "Traceback" not in err
        assert not (tmp_path / "out").exists()  # refused before anything was written
    both = ["--codec", "dynaquant", "--threshold", "0.1", "--bins", "8"]
    assert main(["compress", str(src), str(tmp_path / "out"), "--quiet", *both]) == 1
    assert "--threshold searches --bins" in capsys.readouterr().err
    assert main(["compress", str(src), str(tmp_path / "out"), "--codec", "dynaquant", "--prune", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "argument --prune: must be a fraction in [0, 1), got 1.5" in err and "prune=" not in err


def test_errors_name_the_cli_spelling_in_the_cli_and_the_python_one_in_python(tmp_path: Path, capsys) -> None:
    from hf_dynaquant import DynaQuantError
    from hf_dynaquant.pretrained.folder import compress_folder

    src = tmp_path / "w.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.randn(100, 10)}, str(src))
    (tmp_path / "out").mkdir()
    with pytest.raises(DynaQuantError, match="pass overwrite=True$"):
        compress_folder(src, tmp_path / "out", progress=False)
    assert main(["compress", str(src), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.rstrip().endswith("pass --overwrite") and "overwrite=" not in err


def test_os_errors_are_one_line_naming_the_path(tmp_path: Path, capsys) -> None:
    src = tmp_path / "w.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.randn(100, 10)}, str(src))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["compress", str(src), str(blocker / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"error: {blocker}: File exists (EEXIST)" in err  # the path, the system's reason, its code
    # in a fresh process, as a user runs it: the same single line and a non-zero exit
    exe = Path(sys.executable).parent / "hf-dynaquant"
    run = subprocess.run([exe, "compress", str(src), str(blocker / "out"), "--quiet"], capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and str(blocker) in run.stderr


def test_cli_verify_reports_a_damaged_store_marker(tmp_path: Path, capsys) -> None:
    src = tmp_path / "w.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.randn(100, 10)}, str(src))
    assert main(["compress", str(src), str(tmp_path / "out"), "--quiet"]) == 0
    marker = tmp_path / "out" / "dynaquant" / "store.json"
    marker.write_bytes(marker.read_bytes().replace(b'"format_version":1', b'"format_version":3'))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL store marker") and "damaged" in out and "upgrade" not in out
