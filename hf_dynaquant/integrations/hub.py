"""Compressed pre-trained snapshots on the Hugging Face Hub: compress once, push, pull, fine-tune.

* :func:`compress_pretrained` turns a model (folder or ``PreTrainedModel``) into a **Hub-ready
  folder**: the source's config, tokenizer and processor files; the weights in a DynaQuant store
  (``dynaquant/``, FORMAT.md) chosen by the configuration search against a threshold; a
  ``config.json`` whose ``quantization_config`` (``quant_method: dynaquant``) and
  ``transformers_weights`` let transformers load it directly (:mod:`.hf_quantizer`); and a model
  card (``README.md``) from the template ``model_cards/dynaquant.md`` (:func:`card_template`).
* :func:`push_to_hub` uploads such a folder (compressing first when given a model or a plain
  folder); :func:`pull` downloads one and checks every checksum.
* :func:`from_pretrained` loads a snapshot with public APIs only: ``snapshot_download``, decode
  once into a local cache keyed by the commit and the snapshot's content (checked at every load), then the
  model class's own ``from_pretrained``. ``AutoModel.from_pretrained(repo)`` after
  ``import hf_dynaquant`` gives the same tensors through the quantizer hooks.

Nothing is ever unpickled: weights are safetensors, everything else JSON. ``HF_TOKEN`` and
``HF_ENDPOINT`` are read when a function runs (not only when huggingface_hub was imported).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..core.quantizer import QuantConfig, read_config_record
from ..errors import CorruptCheckpointError, DynaQuantError
from ..pretrained.calibration import DEFAULT_THRESHOLD, PRETRAINED_SPACE, calibration_batches
from ..pretrained.corpus import package_descriptions
from ..pretrained.folder import MODEL_REF, STORE_DIR, compress_folder, find_store
from ..pretrained.snapshot import (
    CONFIG,
    QUANT_METHOD,
    cached_decode,
    is_snapshot,
    materialize_local_snapshot,
    read_config,
)
from ..pretrained.transfer import FineTuneCheck, FineTuneResult, run_fine_tune_check
from ..renames import renamed_keywords
from ..search import QualityMetric, SearchSpace
from ..store.atomic import atomic_write_json, publish_folder, staging_folder
from .hf_quantizer import transformers_sections

__all__ = [
    "DEFAULT_THRESHOLD",
    "PRETRAINED_SPACE",
    "HubSnapshot",
    "compress_pretrained",
    "push_to_hub",
    "pull",
    "from_pretrained",
    "materialize_snapshot",
    "card_template",
]

_PACKAGE = Path(__file__).resolve().parents[1]
# The model-card template: the top-level model_cards/dynaquant.md of the source tree (one source,
# beside the cards made from it), which the build copies into the package (setup.py).
_TEMPLATE = Path("model_cards") / "dynaquant.md"


def card_template() -> Path:
    """The model-card template :func:`compress_pretrained` fills: the copy installed in the package
    (a wheel, ``pip install .``), else the source tree's ``model_cards/dynaquant.md`` (an editable
    install, or the package run from a checkout)."""
    installed, source = _PACKAGE / _TEMPLATE, _PACKAGE.parent / _TEMPLATE
    return installed if installed.is_file() else source


@dataclass(frozen=True)
class HubSnapshot:
    """A Hub-ready folder and what was measured while making it."""

    path: Path
    entry: str
    raw_nbytes: int
    stored_nbytes: int
    config: dict[str, Any] | None  # the DynaQuant configuration chosen
    distortion: float | None  # the searched metric's degradation on calibration text
    cosine: float  # mean cosine of mean-pooled outputs, original vs compressed, on held-out text
    agreement: float  # how often a held-out sentence's nearest neighbour stays the same (see _fidelity)
    fine_tune: FineTuneResult | None = None  # the fine-tune check, when one was asked for

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / self.stored_nbytes


# ---------------------------------------------------------------------------------------------
# compress


@renamed_keywords(data="eval_data", quant="config", space="search_space")
def compress_pretrained(
    model_or_path: str | Path | Any,
    output_dir: str | Path,
    *,
    threshold: float | None = DEFAULT_THRESHOLD,
    metric: QualityMetric | Callable[[torch.nn.Module], float] | None = None,
    eval_data: Any = None,
    config: QuantConfig | None = None,
    search_space: SearchSpace | None = None,
    tokenizer: Any = None,
    base_model: str | None = None,
    template: str | Path | None = None,
    fine_tune: FineTuneCheck | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> HubSnapshot:
    """One-shot compression of a pre-trained model into a Hub-ready folder ``output_dir``.

    The configuration is the most compressive one whose quality loss stays within ``threshold``.
    Quality is ``metric`` (a :class:`~hf_dynaquant.search.QualityMetric` or ``model -> float``,
    lower is better, evaluated on the model loaded with ``AutoModel``) when given; otherwise the
    output cosine distance (1 - the mean cosine similarity of the model's output vectors to the
    original's, position by position; the default 0.015 keeps a mean cosine of 0.985) on
    ``eval_data`` (model-ready batches), by default standard-library docstrings through the
    model's own tokenizer. ``config`` fixes the knobs outside the search (default
    :data:`PRETRAINED_BASE`: frequency-weighted K-means, error feedback and rare embedding rows
    calibrated on the same text); ``search_space`` is the searched cube (default :data:`PRETRAINED_SPACE`). With
    ``threshold=None`` there is no search: ``config`` is used as it is. (Before: ``data=``,
    ``quant=``, ``space=``, still accepted for one release.)

    ``model_or_path``: a model folder, or a ``PreTrainedModel`` (saved first, with ``tokenizer``
    when given). ``base_model`` names the source repo in the card (default: the config's
    ``_name_or_path``). ``output_dir`` appears complete or not at all.

    ``fine_tune`` (a :class:`~hf_dynaquant.pretrained.transfer.FineTuneCheck`, e.g.
    :func:`~hf_dynaquant.pretrained.transfer.topic_classification` for a text encoder) fine-tunes
    the original and the finished snapshot with the same seeds before the card is written, and
    the card states both arms' metric and their paired difference with its 95% interval.
    Without it the card says that fine-tuning was not measured. A fine-tune takes minutes per
    seed and arm on a CPU.
    """
    output_dir = Path(output_dir)
    with tempfile.TemporaryDirectory(prefix="hf-dynaquant-src-") as tmp:
        src = _as_folder(model_or_path, Path(tmp), tokenizer)
        source_config = read_config(src)
        if metric is not None and not isinstance(metric, QualityMetric):
            metric = QualityMetric(metric, higher_is_better=False, name=getattr(metric, "__name__", "metric"))
        with staging_folder(output_dir) as staging:
            result = compress_folder(
                src,
                staging / "snapshot",
                codec="dynaquant",
                config=config,
                threshold=threshold,
                search=None
                if threshold is None
                else {"metric": metric, "eval_data": eval_data, "search_space": search_space},
                progress=progress,
            )
            folder = result.path
            store = find_store(folder)
            with store.open(MODEL_REF) as entry:
                search = entry.metadata.get("search") or {"config": entry.metadata.get("quant_config")}
                chosen = search.get("config")
                sections = transformers_sections(entry.sections)
                decoded = {s: entry.load_section(s) for s in sections}
            snapshot = HubSnapshot(
                path=output_dir,
                entry=result.entry,
                raw_nbytes=result.raw_nbytes,
                stored_nbytes=result.stored_nbytes,
                config=None if chosen is None else read_config_record(chosen),
                distortion=search.get("degradation"),
                **_fidelity(src, decoded),
            )
            _write_hub_config(folder, source_config, snapshot, sections)
            if fine_tune is not None:  # on the finished folder, loaded as its users will load it
                checked = run_fine_tune_check(src, folder, fine_tune, progress=progress)
                snapshot = replace(snapshot, fine_tune=checked)
            base = base_model or source_config.get("_name_or_path") or None
            _write_card(folder, snapshot, base, threshold, template)
            publish_folder(folder, output_dir, overwrite)
    return snapshot


def _as_folder(model_or_path: Any, tmp: Path, tokenizer: Any) -> Path:
    """A model folder for ``model_or_path`` (a ``PreTrainedModel`` is saved into ``tmp``)."""
    if isinstance(model_or_path, (str, Path)):
        path = Path(model_or_path)
        if not (path / CONFIG).is_file():
            raise DynaQuantError(f"{path}: not a Hugging Face model folder (no {CONFIG})")
        return path
    if not hasattr(model_or_path, "save_pretrained"):
        raise DynaQuantError(f"expected a model folder or a transformers PreTrainedModel, got {type(model_or_path)}")
    model_or_path.save_pretrained(tmp)  # safetensors: v5 writes nothing else
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    return tmp


# Held-out sentences the fidelity in a model card is measured on (package descriptions: text
# the docstring calibration never reads), and how many the neighbour agreement needs to mean much.
_CARD_SENTENCES, _MIN_SENTENCES = 256, 32


def _fidelity(src: Path, decoded: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """``{"cosine", "agreement"}`` of the decoded weights against the original model on held-out
    text: the mean cosine similarity of mean-pooled final hidden states, and the top-1 neighbour
    agreement (how often each sentence's nearest other sentence, by those embeddings, stays the
    same). The text: sentences of the installed packages' descriptions
    (:func:`~hf_dynaquant.pretrained.corpus.package_descriptions`), or docstring paragraphs the
    search did not see where too few packages are installed."""
    from transformers import AutoModel, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src))
    except (OSError, ValueError) as exc:
        raise DynaQuantError(f"{src}: no tokenizer to measure the snapshot's fidelity ({exc})") from None
    sentences = package_descriptions(_CARD_SENTENCES)
    if len(sentences) >= _MIN_SENTENCES:
        batches = [
            tokenizer(sentences[i : i + 32], padding=True, truncation=True, return_tensors="pt")
            for i in range(0, len(sentences), 32)
        ]
    else:
        batches = calibration_batches(tokenizer, batches=2, batch_size=16, offset=1)
    original = AutoModel.from_pretrained(str(src)).eval()
    compressed = AutoModel.from_pretrained(str(src)).eval()
    state = {name: t for section in decoded.values() for name, t in section.items()}
    missing = _load_into(compressed, state)
    if missing:
        raise DynaQuantError(f"{src}: decoded weights do not cover {missing[:3]} of the model")
    pooled: dict[str, list[torch.Tensor]] = {"original": [], "compressed": []}
    with torch.no_grad():
        for batch in batches:
            mask = batch["attention_mask"].unsqueeze(-1).float()
            for name, model in (("original", original), ("compressed", compressed)):
                pooled[name].append((model(**dict(batch)).last_hidden_state * mask).sum(1) / mask.sum(1))
    a, b = (torch.nn.functional.normalize(torch.cat(pooled[k]), dim=-1) for k in ("original", "compressed"))
    nearest = [(e @ e.T).fill_diagonal_(-2).argmax(1) for e in (a, b)]
    return {"cosine": float((a * b).sum(1).mean()), "agreement": float((nearest[0] == nearest[1]).float().mean())}


def _load_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> list[str]:
    """Load checkpoint tensors (names with or without the base-model prefix); the model's
    parameters that got nothing."""
    prefix = getattr(model, "base_model_prefix", "")
    own = model.state_dict()
    matched = {}
    for name, t in state.items():
        for candidate in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
            if candidate in own:
                matched[candidate] = t
                break
    model.load_state_dict(matched, strict=False)
    return [n for n, _ in model.named_parameters() if n not in matched]


def _write_hub_config(folder: Path, source: dict[str, Any], snap: HubSnapshot, sections: list[str]) -> None:
    """config.json: the source's, plus the quantization config and the payload for transformers."""
    config = dict(source)
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format_version": 1,
        "store": STORE_DIR,
        "entry": snap.entry,
        "sections": sections,
        "config": snap.config,
        "dequantize": True,
    }
    config["transformers_weights"] = f"{STORE_DIR}/entries/{snap.entry}/payload.safetensors"
    config.setdefault("dtype", config.get("torch_dtype") or "float32")
    atomic_write_json(folder / CONFIG, config, sort_keys=True)


def _write_card(folder: Path, snap: HubSnapshot, base_model: str | None, threshold: float, template: Any) -> None:
    """README.md: a model card from the template (YAML header + body), replacing the source's."""
    from huggingface_hub import ModelCard, ModelCardData

    template = Path(template) if template is not None else card_template()
    if not template.is_file():
        raise DynaQuantError(f"model-card template {template} not found; pass template=<path>")
    data = ModelCardData(
        base_model=base_model,
        base_model_relation="quantized" if base_model else None,
        library_name="transformers",
        tags=["dynaquant", "hf_dynaquant", "quantized", "compressed"],
    )
    card = ModelCard.from_template(
        data,
        template_path=str(template),
        base_model=base_model or "the original model",
        ratio=f"{snap.ratio:.2f}",
        raw_mb=f"{snap.raw_nbytes / 1e6:.2f}",
        stored_mb=f"{snap.stored_nbytes / 1e6:.2f}",
        config=snap.config or {},
        distortion="n/a" if snap.distortion is None else f"{snap.distortion:.4f}",
        threshold=threshold,
        cosine=f"{snap.cosine:.4f}",
        agreement=f"{snap.agreement:.3f}",
        fine_tune=None if snap.fine_tune is None else _card_fine_tune(snap.fine_tune),
        entry=snap.entry,
    )
    (folder / "README.md").write_text(str(card))


def _card_fine_tune(result: FineTuneResult) -> dict[str, Any]:
    """The fine-tune check's figures as the card prints them: an accuracy in percent (its
    difference in points), any other metric to four significant digits."""
    if result.metric == "accuracy":
        arm, diff = "{:.2f} ± {:.2f}%", "{:+.2f} ± {:.2f} points"
        scale = 100.0
    else:
        arm, diff = "{:.4g} ± {:.4g}", "{:+.4g} ± {:.4g}"
        scale = 1.0
    figures = {name: arm.format(*(scale * v for v in result.summary(name))) for name in ("original", "snapshot")}
    return {
        "task": result.task,
        "metric": result.metric,
        "seeds": len(result.seeds),
        **figures,
        "difference": diff.format(scale * result.difference, scale * result.interval),
    }


# ---------------------------------------------------------------------------------------------
# push and pull


def _endpoint(endpoint: str | None) -> str | None:
    return endpoint or os.environ.get("HF_ENDPOINT") or None


def push_to_hub(
    folder_or_model: str | Path | Any,
    repo_id: str,
    *,
    token: str | None = None,
    revision: str | None = None,
    private: bool | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    endpoint: str | None = None,
    **compress: Any,
) -> Any:
    """Upload a Hub-ready folder to ``repo_id`` (created if missing; ``revision`` is a branch,
    created from main if missing). Given a ``PreTrainedModel`` or a plain model folder, it is
    compressed first with :func:`compress_pretrained` (``compress`` holds its options). The
    token defaults to ``HF_TOKEN`` / the saved login, the server to ``HF_ENDPOINT``. Returns
    huggingface_hub's ``CommitInfo``."""
    from huggingface_hub import HfApi

    with tempfile.TemporaryDirectory(prefix="hf-dynaquant-push-") as tmp:
        folder = Path(folder_or_model) if isinstance(folder_or_model, (str, Path)) else None
        if folder is None or not is_snapshot(folder):
            folder = compress_pretrained(folder_or_model, Path(tmp) / "snapshot", **compress).path
        elif compress:
            raise DynaQuantError(f"{folder} is already compressed; compression options {sorted(compress)} do not apply")
        problems = find_store(folder).verify(pretrained=False)
        if problems:
            raise CorruptCheckpointError(f"{folder}: refusing to push a damaged snapshot: {problems[0]}")
        api = HfApi(endpoint=_endpoint(endpoint), token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = find_store(folder).info(MODEL_REF)
        return api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            revision=revision,
            commit_message=commit_message or f"DynaQuant snapshot ({info.ratio:.1f}x smaller weights)",
            create_pr=create_pr,
        )


def pull(
    repo_id: str,
    local_dir: str | Path | None = None,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | Path | None = None,
    endpoint: str | None = None,
) -> Path:
    """Download a DynaQuant snapshot (into the Hugging Face cache, or ``local_dir``) and check
    it: its config must name the dynaquant method and every blob checksum and manifest must be
    intact. Returns the snapshot folder (for the cache: ``.../snapshots/<commit>``)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    where = f"{repo_id}@{revision or 'main'}"
    try:
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                token=token,
                cache_dir=cache_dir,
                local_dir=local_dir,
                endpoint=_endpoint(endpoint),
            )
        )
    except HfHubHTTPError as exc:
        raise DynaQuantError(f"{where}: download failed ({exc})") from None
    if not is_snapshot(path):
        raise DynaQuantError(f"{where}: not a DynaQuant snapshot (config.json names no quant_method {QUANT_METHOD!r})")
    try:
        problems = find_store(path).verify(pretrained=False)
    except DynaQuantError as exc:
        problems = [str(exc)]
    if problems:
        raise CorruptCheckpointError(f"{where}: the snapshot is damaged: " + "; ".join(problems))
    return path


# ---------------------------------------------------------------------------------------------
# load


def materialize_snapshot(
    repo_id_or_path: str | Path,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | Path | None = None,
    hub_cache_dir: str | Path | None = None,
    endpoint: str | None = None,
) -> Path:
    """A plain model folder (float safetensors, config without the quantization entries) for a
    snapshot (a local folder or a Hub repo), decoded once and kept in ``cache_dir`` (default
    ``$HF_DYNAQUANT_CACHE`` or ``~/.cache/hf_dynaquant/decoded``).

    Every call checks the snapshot first (every blob checksum; a local folder is checked where it
    is, by :func:`~hf_dynaquant.pretrained.snapshot.materialize_local_snapshot`, a repo by
    :func:`pull`), and the decoded copy is keyed by everything it is made of
    (:func:`~hf_dynaquant.pretrained.snapshot.snapshot_key`), so an edited ``config.json`` or
    tokenizer is decoded afresh and a damaged payload is a :class:`CorruptCheckpointError`, never
    an earlier decode."""
    local = Path(repo_id_or_path)
    if local.is_dir():
        return materialize_local_snapshot(local, cache_dir=cache_dir)
    src = pull(str(repo_id_or_path), revision=revision, token=token, cache_dir=hub_cache_dir, endpoint=endpoint)
    return cached_decode(src, Path(str(repo_id_or_path).replace("/", "--")) / src.name, cache_dir)  # name: commit


def from_pretrained(
    model_class: Any,
    repo_id_or_path: str | Path,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | Path | None = None,
    endpoint: str | None = None,
    **kwargs: Any,
) -> Any:
    """``model_class.from_pretrained`` on a DynaQuant snapshot (repo id or folder), with public
    APIs only: download, decode once into the cache (:func:`materialize_snapshot`), then load the
    plain folder. ``kwargs`` go to ``model_class.from_pretrained`` (``num_labels=3``, ``dtype``...)."""
    folder = materialize_snapshot(
        repo_id_or_path, revision=revision, token=token, cache_dir=cache_dir, endpoint=endpoint
    )
    return model_class.from_pretrained(str(folder), **kwargs)
