"""Configuration search and calibration for a saved pre-trained model, with nothing asked of the user.

Without the user's own metric and data, quality is the model's faithfulness to itself: the
cosine distance between the original model's outputs and the quantized model's, position by
position (:func:`~hf_dynaquant.search.output_cosine`), on calibration text: standard-library
docstrings, tokenized with the model's own tokenizer. The search picks the most compressive configuration
whose distortion stays within the threshold.

The same text calibrates the quantizer (:func:`calibrate`): the Gram matrix of every linear
layer's inputs, for rounding with error feedback (``QuantConfig.error_feedback``, on in
:data:`PRETRAINED_BASE`).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.quantizer import Calibration, QuantConfig, layer_types
from ..errors import DynaQuantError
from ..renames import renamed_keywords
from ..search import ConfigurationSearch, QualityMetric, SearchResult, SearchSpace, output_cosine
from .corpus import docstring_corpus

__all__ = [
    "DEFAULT_THRESHOLD",
    "PRETRAINED_BASE",
    "PRETRAINED_SPACE",
    "calibration_batches",
    "calibrate",
    "calibrate_folder",
    "load_model",
    "search_pretrained",
]

logger = logging.getLogger(__name__)

# Batches of calibration text (8 paragraphs of up to 128 tokens each) the Gram matrices of error
# feedback are summed over: 4x the search's, since a better estimate of the inputs' correlations
# carries over to text the calibration did not see (measured on MiniLM, RESULTS issue 19).
CALIBRATION_BATCHES = 16


# The output cosine distance (search.output_cosine: 1 - the mean cosine similarity of the
# model's output vectors to the original's, token by token on calibration text) a snapshot may
# cost by default. Measured on all-MiniLM-L6-v2 (benchmarks/RESULTS.md, issue 19), a distance d
# on the calibration text went with held-out sentence-embedding cosines of about 1 - 1.5 d:
# 0.007 -> 0.984, 0.013 -> 0.977, 0.022 -> 0.966, 0.046 -> 0.933. 0.015 keeps about 0.97.
DEFAULT_THRESHOLD = 0.015

# The cube for pre-trained snapshots: Table 7's axes with 24 bins in place of 32 (a snapshot that
# needs 32 bins everywhere is better stored losslessly). With calibration the embedding's rows
# are split (QuantConfig.rare_bins): the rows calibration text uses get 16 levels, the rest 3
# (session 12: 0.97 held-out cosine where 3 levels on every row gave 0.94 at about the size).
PRETRAINED_SPACE = SearchSpace(
    bins=(4, 6, 8, 12, 16, 24), prune=(0.2, 0.1, 0.0), protect=(0.0005, 0.005), embedding_bins=(16,)
)

# Frequency-only K-means weighting (sigma = 1): it minimises the squared error of the weights,
# which measured better output fidelity on pre-trained MiniLM than the paper's 0.2 (tuned for
# training checkpoints) at every bin count we tried. Error feedback on calibration text keeps
# the layers' outputs closer at the same bins, and the input embedding's rows that calibration
# text never uses get 3 levels. K-means codebooks, not trellis-coded quantization
# (QuantConfig.trellis), because people fine-tune a snapshot (benchmarks/RESULTS.md, issue 19,
# 37 paired seeds each): at the default threshold this base's search chooses 16 bins with 10%
# pruned, which fine-tuned 0.22 ± 0.49 points above the original; with the trellis the search
# chooses 24 bins and no pruning, which fine-tuned 0.69 ± 0.52 points below that. The trellis
# itself is not the cause: at 16 bins with 10% pruned (threshold 0.02) it fine-tunes as well
# (-0.06 ± 0.43 against K-means; 12.03x, +0.16 ± 0.47 against the original).
PRETRAINED_BASE = QuantConfig(sigma=1.0, error_feedback=True, rare_bins=3)


def calibration_batches(
    tokenizer: Any, *, batches: int = 4, batch_size: int = 8, seq_len: int = 128, offset: int = 0
) -> list[dict]:
    """Tokenized docstring text, as model-ready batches (deterministic). Paragraphs are taken at
    an even stride through the corpus; a different ``offset`` (below the stride) gives disjoint
    text, e.g. held-out text for measuring what the search was not tuned on."""
    paragraphs = [p for p in docstring_corpus().split("\n\n") if len(p) > 200]
    step = max(1, len(paragraphs) // (batches * batch_size))
    texts = paragraphs[offset % step :: step][: batches * batch_size]
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(
            texts[i : i + batch_size], return_tensors="pt", padding=True, truncation=True, max_length=seq_len
        )
        out.append(dict(enc))
    return out


def calibrate(model: torch.nn.Module, batches: Any, tokens: Any = None) -> Calibration:
    """The :class:`~hf_dynaquant.core.quantizer.Calibration` of ``model`` on ``batches``
    (model-ready dicts): the Gram matrix ``X Xᵀ`` of the inputs of every ``nn.Linear``, summed
    over every position of every batch that its ``attention_mask`` (if any) keeps, under the name
    of the layer's weight; and how often each row of the input embedding is used by the batches'
    ``input_ids`` and by ``tokens`` (more token ids, e.g. a whole corpus, as tensors). Rows are
    not counted where the output layer shares the input embedding's weight: every row then
    scores every position's output, used or not."""
    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, np.ndarray] = {}
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    embedding = get_input() if get_input is not None else None
    output = get_output() if get_output is not None else None
    if isinstance(embedding, torch.nn.Embedding) and getattr(output, "weight", None) is not embedding.weight:
        ids = [b["input_ids"] for b in batches if isinstance(b, dict) and "input_ids" in b] + list(tokens or [])
        used = sum(torch.bincount(torch.as_tensor(t).reshape(-1), minlength=embedding.num_embeddings) for t in ids)
        name = next(n for n, m in model.named_modules() if m is embedding)
        if isinstance(used, torch.Tensor):
            rows[f"{name}.weight" if name else "weight"] = used[: embedding.num_embeddings].numpy()

    mask: list[torch.Tensor | None] = [None]  # the batch's attention mask, to leave padding out

    def hook(name: str):
        def record(module: torch.nn.Module, args: tuple, output: Any) -> None:
            x = args[0].detach()
            if mask[0] is not None and x.shape[:-1] == mask[0].shape:
                x = x[mask[0]]
            x = x.reshape(-1, x.shape[-1]).float()
            gram = (x.T @ x).double()  # a batch's sum in float32, the batches' in float64
            sums[name] = sums[name] + gram if name in sums else gram

        return record

    handles = [
        module.register_forward_hook(hook(f"{name}.weight" if name else "weight"))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    try:
        with torch.no_grad():
            for batch in batches:
                given = batch.get("attention_mask") if isinstance(batch, dict) else None
                mask[0] = given.bool() if isinstance(given, torch.Tensor) else None
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return Calibration(
        {name: gram.to(torch.float32) for name, gram in sums.items()},
        rows,
    )


def load_model(folder: str | Path) -> Any:
    """The model of ``folder`` through transformers' ``AutoModel``, in eval mode (what the
    calibration and the search evaluate; load it once and pass it to both)."""
    from transformers import AutoModel

    try:
        return AutoModel.from_pretrained(str(folder)).eval()
    except (OSError, ValueError) as exc:
        raise DynaQuantError(
            f"{folder}: cannot load the model to evaluate configurations ({exc}); "
            "give a fixed configuration (bins=, prune=, protect=) instead of threshold="
        ) from None


def _tokenizer(folder: str | Path) -> Any:
    """The tokenizer of ``folder``, for calibration text."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise DynaQuantError(f"{folder}: no tokenizer for calibration text ({exc})") from None


def _calibration_text(folder: str | Path) -> list[dict]:
    """Calibration text through the tokenizer of ``folder``."""
    return calibration_batches(_tokenizer(folder))


def corpus_tokens(tokenizer: Any) -> list[torch.Tensor]:
    """The token ids of the whole calibration corpus (every docstring paragraph; the special
    tokens a model input adds are in the batches): which rows of the input embedding text like it
    uses, counted over far more text than the batches a forward pass can afford."""
    paragraphs = [p for p in docstring_corpus().split("\n\n") if p.strip()]
    ids = tokenizer(paragraphs, add_special_tokens=False, verbose=False)["input_ids"]
    return [torch.tensor(seq, dtype=torch.int64) for seq in ids if seq]


def calibrate_folder(folder: str | Path, eval_data: Any = None, *, model: Any = None) -> Calibration | None:
    """:func:`calibrate` for the model saved in ``folder``, on ``eval_data`` (model-ready batches)
    or else calibration text (its rows counted over the whole corpus, :func:`corpus_tokens`);
    ``None``, with a warning logged, where the folder holds no model and tokenizer transformers
    can load (a lone weights file): the weights are then rounded each to its nearest centre.
    ``model``: that folder's model, loaded already (see :func:`load_model`)."""
    try:
        model = model if model is not None else load_model(folder)
        if eval_data is not None:
            return calibrate(model, eval_data)
        tokenizer = _tokenizer(folder)
        batches = calibration_batches(tokenizer, batches=CALIBRATION_BATCHES)
        return calibrate(model, batches, corpus_tokens(tokenizer))
    except DynaQuantError as exc:
        logger.warning("no calibration for error feedback, weights rounded to the nearest centre: %s", exc)
        return None


@renamed_keywords(space="search_space", base="config", data="eval_data")
def search_pretrained(
    folder: str | Path,
    threshold: float,
    *,
    metric: QualityMetric | None = None,
    search_space: SearchSpace | None = None,
    config: QuantConfig | None = None,
    eval_data: Any = None,
    calibration: Calibration | None = None,
    progress: bool = False,
    model: Any = None,
) -> SearchResult:
    """Search the configuration for the model in ``folder`` (loaded with transformers'
    ``AutoModel``). Quality is ``metric`` when given, else the output cosine distance
    (:func:`~hf_dynaquant.search.output_cosine`) on ``eval_data``
    (model-ready batches), by default calibration text through the model's ``AutoTokenizer``.
    The cube (``search_space``) and fixed knobs (``config``) default to the pre-trained presets
    (:data:`PRETRAINED_SPACE`, :data:`PRETRAINED_BASE`), whichever entry point searches (Python,
    the CLI, the Hub tools). ``calibration`` (see :func:`calibrate_folder`) is what candidates
    with error feedback round with; ``progress`` shows the candidates as they are evaluated;
    ``model``: the folder's model, loaded already (see :func:`load_model`)."""
    model = model if model is not None else load_model(folder)
    if metric is None:
        metric = output_cosine(model, eval_data if eval_data is not None else _calibration_text(folder))
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    search = ConfigurationSearch(
        metric,
        threshold,
        search_space=search_space or PRETRAINED_SPACE,
        config=config or PRETRAINED_BASE,
        progress=progress,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*needs gradients.*")  # a saved model has none
        with torch.no_grad():
            return search.search(model, snapshot, types=layer_types(model), calibration=calibration)
