"""Configuration search for a saved pre-trained model, with nothing asked of the user.

Without the user's own metric and data, quality is the model's faithfulness to itself: the
relative squared error between the original model's outputs and the quantized model's outputs
(:func:`~hf_dynaquant.search.output_distortion`) on calibration text: standard-library docstrings,
tokenized with the model's own tokenizer. The search picks the most compressive configuration
whose distortion stays within the threshold.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ..core.quantizer import QuantConfig, layer_types
from ..errors import DynaQuantError
from ..renames import renamed_keywords
from ..search import ConfigurationSearch, QualityMetric, SearchResult, SearchSpace, output_distortion
from .corpus import docstring_corpus

__all__ = ["DEFAULT_THRESHOLD", "PRETRAINED_BASE", "PRETRAINED_SPACE", "calibration_batches", "search_pretrained"]


# Output distortion (relative squared error of the model's outputs on calibration text) a
# snapshot may cost by default. On all-MiniLM-L6-v2 it admits ~13x; fine-tuning from that
# snapshot lands within one standard deviation of fine-tuning from the original
# (benchmarks/RESULTS.md, "Hub snapshots").
DEFAULT_THRESHOLD = 0.4

# The cube for pre-trained snapshots: Table 7's axes without 32 bins (a snapshot that needs 32
# bins everywhere is better stored losslessly) and with embeddings fixed at 3 levels. Embedding
# tables are half of a small encoder's bytes and, measured on MiniLM, the least sensitive part
# (16 levels on the embeddings alone keep 0.999 sentence-embedding cosine); the search only tries
# fewer embedding levels after settling the rest, when the budget is spent, so with the
# paper's (16, 32) it stopped at 9.3x where fixing 3 levels reaches 12x at the same distortion
# (measured before the rANS coder; 13.45x with it).
PRETRAINED_SPACE = SearchSpace(bins=(4, 6, 8, 12, 16), embedding_bins=(3,))

# Frequency-only K-means weighting (sigma = 1): it minimises the squared error of the weights,
# which measured better output fidelity on pre-trained MiniLM than the paper's 0.2 (tuned for
# training checkpoints) at every bin count we tried.
PRETRAINED_BASE = QuantConfig(sigma=1.0)


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


@renamed_keywords(space="search_space", base="config", data="eval_data")
def search_pretrained(
    folder: str | Path,
    threshold: float,
    *,
    metric: QualityMetric | None = None,
    search_space: SearchSpace | None = None,
    config: QuantConfig | None = None,
    eval_data: Any = None,
) -> SearchResult:
    """Search the configuration for the model in ``folder`` (loaded with transformers'
    ``AutoModel``). Quality is ``metric`` when given, else the output distortion on ``eval_data``
    (model-ready batches), by default calibration text through the model's ``AutoTokenizer``.
    The cube (``search_space``) and fixed knobs (``config``) default to the pre-trained presets
    (:data:`PRETRAINED_SPACE`, :data:`PRETRAINED_BASE`), whichever entry point searches (Python,
    the CLI, the Hub tools)."""
    from transformers import AutoModel, AutoTokenizer

    try:
        model = AutoModel.from_pretrained(str(folder)).eval()
    except (OSError, ValueError) as exc:
        raise DynaQuantError(
            f"{folder}: cannot load the model to evaluate configurations ({exc}); "
            "give a fixed configuration (bins=, prune=, protect=) instead of threshold="
        ) from None
    if metric is None and eval_data is not None:
        metric = output_distortion(model, eval_data)
    if metric is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise DynaQuantError(f"{folder}: no tokenizer for calibration text ({exc})") from None
        metric = output_distortion(model, calibration_batches(tokenizer))
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    search = ConfigurationSearch(
        metric, threshold, search_space=search_space or PRETRAINED_SPACE, config=config or PRETRAINED_BASE
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*needs gradients.*")  # a saved model has none
        with torch.no_grad():
            return search.search(model, snapshot, types=layer_types(model))
