"""Names changed by issue 17 (one name per concept: ``config``, ``search_space``, ``eval_data``,
``prune_by``): each old keyword, options key and CLI flag still works for one release, with a
FutureWarning naming the new one; giving both is an InvalidSettingError; and records stored with
the old key (``metric`` for the pruning criterion) read back as before."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import hf_dynaquant
from hf_dynaquant import InvalidSettingError, QuantConfig, SearchSpace, compress_folder
from hf_dynaquant.cli import main as cli_main
from hf_dynaquant.core.quantizer import read_config_record
from hf_dynaquant.inspection import search_lines
from hf_dynaquant.pretrained.calibration import calibration_batches, search_pretrained
from hf_dynaquant.pretrained.folder import find_store
from hf_dynaquant.search import (
    ConfigurationSearch,
    QualityMetric,
    accuracy,
    held_out,
    mean_loss,
    output_distortion,
    perplexity,
)

torch.manual_seed(0)
MODEL = torch.nn.Linear(4, 3).requires_grad_(False)
BATCHES = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
SPACE = SearchSpace(bins=(4, 8), prune=(0.0,), protect=(0.005,), prune_by=("magnitude",))
CONFIG = QuantConfig(min_numel=4)
# one point, for searches on the real MiniLM that only check which names reach the search
ONE_POINT = SearchSpace(bins=(8,), prune=(0.2,), protect=(0.0005,), prune_by=("magnitude",), embedding_bins=(16,))
FIXED = QuantConfig(bins=8, prune=0.2, protect=0.0005, embedding_bins=16, sigma=1.0)


def _search(**kw: Any) -> tuple:
    search = ConfigurationSearch(mean_loss(BATCHES), 0.01, **kw)
    return search.search_space, search.config


# (what is called, its old keywords, the same with the new names): the results must be equal
CHEAP: dict[str, tuple[Callable[..., Any], dict[str, Any], dict[str, Any]]] = {
    "QuantConfig": (QuantConfig, {"metric": "sensitivity"}, {"prune_by": "sensitivity"}),
    "SearchSpace": (SearchSpace, {"metrics": ("magnitude",)}, {"prune_by": ("magnitude",)}),
    "SearchSpace.config": (
        lambda **kw: SPACE.config((1, 0, 0), embedding_bins=32, **kw),
        {"metric": "magnitude", "base": CONFIG},
        {"prune_by": "magnitude", "config": CONFIG},
    ),
    "ConfigurationSearch": (_search, {"space": SPACE, "base": CONFIG}, {"search_space": SPACE, "config": CONFIG}),
    "mean_loss": (lambda **kw: mean_loss(**kw)(MODEL), {"data": BATCHES}, {"eval_data": BATCHES}),
    "perplexity": (lambda **kw: perplexity(**kw)(MODEL), {"data": BATCHES}, {"eval_data": BATCHES}),
    "accuracy": (lambda **kw: accuracy(**kw)(MODEL), {"data": BATCHES}, {"eval_data": BATCHES}),
    "output_distortion": (
        lambda **kw: output_distortion(MODEL, **kw)(MODEL),
        {"data": [x for x, _ in BATCHES]},
        {"eval_data": [x for x, _ in BATCHES]},
    ),
    "held_out": (lambda **kw: len(held_out(n=1, **kw)), {"data": BATCHES}, {"eval_data": BATCHES}),
}


@pytest.mark.parametrize("name", CHEAP)
def test_old_keywords_warn_and_still_work(name: str) -> None:
    func, old, new = CHEAP[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the new names are not deprecated
        expected = func(**new)
    for old_name, new_name in zip(old, new):
        with pytest.warns(FutureWarning, match=rf"{old_name}= is deprecated .*use {new_name}="):
            got = func(**{old_name: old[old_name], **{k: v for k, v in new.items() if k != new_name}})
        assert got == expected


@pytest.mark.parametrize(
    "call",
    [
        *(lambda name=name: CHEAP[name][0](**CHEAP[name][1], **CHEAP[name][2]) for name in CHEAP),
        lambda: compress_folder("unused", "unused", quant=FIXED, config=FIXED),
        lambda: hf_dynaquant.compress_pretrained("unused", "unused", space=SPACE, search_space=SPACE),
        lambda: hf_dynaquant.compress_pretrained("unused", "unused", data=BATCHES, eval_data=BATCHES),
        lambda: search_pretrained("unused", 0.1, base=FIXED, config=FIXED),
    ],
)
def test_old_and_new_name_together_is_an_error(call: Callable[[], Any]) -> None:
    with pytest.raises(InvalidSettingError, match=r"were both given; pass \w+= only"):
        call()


def test_quantconfig_and_searchspace_old_attributes_warn() -> None:
    with pytest.warns(FutureWarning, match=r"QuantConfig.metric is deprecated .*use .prune_by"):
        assert QuantConfig(prune_by="sensitivity").metric == "sensitivity"
    with pytest.warns(FutureWarning, match=r"SearchSpace.metrics is deprecated .*use .prune_by"):
        assert SPACE.metrics == ("magnitude",)
    search = ConfigurationSearch(mean_loss(BATCHES), search_space=SPACE, config=CONFIG)
    with pytest.warns(FutureWarning, match=r"use .search_space"):
        assert search.space is SPACE
    with pytest.warns(FutureWarning, match=r"use .config"):
        assert search.base is CONFIG


def test_folder_and_pretrained_old_names_still_work(minilm_dir: Path, tmp_path: Path) -> None:
    """``compress_folder(quant=, search={"space", "data"})``, ``search_pretrained(space=, base=,
    data=)`` and ``compress_pretrained(quant=, space=)`` reach what the new names reach."""
    src = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(64, 128)}, str(src))
    with pytest.warns(FutureWarning, match="quant= is deprecated"):
        out = compress_folder(src, tmp_path / "fixed", codec="dynaquant", quant=QuantConfig(bins=8), progress=False)
    assert find_store(out.path).open("model").metadata["quant_config"]["bins"] == 8

    def weights(model: torch.nn.Module) -> float:
        return float(model.embeddings.word_embeddings.weight.float().pow(2).mean())

    with pytest.warns(FutureWarning, match="'space' is deprecated .*use 'search_space'"):
        out = compress_folder(
            minilm_dir, tmp_path / "searched", codec="dynaquant", config=FIXED, threshold=0.5,
            search={"metric": QualityMetric(weights), "space": ONE_POINT}, progress=False,
        )  # fmt: skip
    assert find_store(out.path).open("model").metadata["search"]["config"]["bins"] == 8

    from transformers import AutoTokenizer

    batches = calibration_batches(AutoTokenizer.from_pretrained(str(minilm_dir)), batches=1, batch_size=2)
    with pytest.warns(FutureWarning, match="is deprecated") as caught:
        result = search_pretrained(minilm_dir, 0.5, space=ONE_POINT, base=FIXED, data=batches)
    assert {str(w.message).split(": ")[1].split(" ")[0] for w in caught} >= {"space=", "base=", "data="}
    assert result.config is not None and (result.config.bins, result.config.sigma) == (8, 1.0)

    with pytest.warns(FutureWarning, match="is deprecated"):
        snap = hf_dynaquant.compress_pretrained(
            minilm_dir, tmp_path / "snap", threshold=0.5, metric=weights, space=ONE_POINT, quant=FIXED, progress=False
        )
    assert snap.config is not None and snap.config["bins"] == 8 and snap.config["prune_by"] == "magnitude"
    assert "| magnitude |" in (snap.path / "README.md").read_text()  # the card's pruning criterion


def test_cli_metric_flag_is_a_warning_alias_of_prune_by(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(64, 128)}, str(src))
    base = ["compress", str(src), "--codec", "dynaquant", "--quiet"]
    with pytest.warns(FutureWarning, match="--metric is deprecated .*use --prune-by"):
        assert cli_main([*base[:2], str(tmp_path / "old"), *base[2:], "--metric", "magnitude"]) == 0
    assert find_store(tmp_path / "old").open("model").metadata["quant_config"]["prune_by"] == "magnitude"
    capsys.readouterr()
    assert cli_main(["compress", "--help"]) == 0
    shown = capsys.readouterr().out
    assert "--prune-by" in shown and "--metric" not in shown  # the old flag is hidden
    args = [*base[:2], str(tmp_path / "both"), *base[2:], "--metric", "magnitude", "--prune-by", "magnitude"]
    assert cli_main(args) == 1
    assert "--prune-by and --metric (its old name) were both given" in capsys.readouterr().err


def _old_record(config: QuantConfig) -> dict[str, Any]:
    """``config`` as entries written before ``prune_by`` recorded it (the criterion under ``metric``)."""
    record = config.to_dict()
    record["metric"] = record.pop("prune_by")
    return record


def test_records_with_the_old_key_still_read(tmp_path: Path) -> None:
    chosen = SPACE.config((1, 0, 0), "magnitude", CONFIG, 32)
    assert read_config_record(_old_record(chosen)) == chosen.to_dict() == read_config_record(chosen.to_dict())
    # a resumed search goes on from an old entry's quant_config as from a new one's
    search = ConfigurationSearch(mean_loss(BATCHES), search_space=SPACE, config=CONFIG)
    search.continue_from(_old_record(chosen))
    assert search.last == chosen
    search.continue_from(chosen.to_dict())
    assert search.last == chosen
    # inspect shows an old search record (configuration and candidates with "metric")
    candidate = {**_old_record(chosen), "degradation": 0.001, "bits": 3.5, "passed": True}
    record = {"mode": "exhaustive", "evaluations": 1, "config": _old_record(chosen), "degradation": 0.001}
    lines = search_lines({**record, "baseline": 0.5, "candidates": [candidate]})
    assert "prune_by=magnitude" in lines[0] and "magnitude" in lines[-1] and lines[-1].endswith("yes")
