"""The configuration search (the paper's section 5): which quantization configuration each
checkpoint is stored with, judged by a quality metric on a decoded copy of the model.

:mod:`.quality` holds the metrics, :mod:`.space` the cube and the results, :mod:`.configuration`
the search itself (:class:`ConfigurationSearch`).
"""

from .configuration import ConfigurationSearch, Lockstep, evaluate_plan, measured_bits
from .quality import (
    Measurement,
    QualityMetric,
    accuracy,
    device_of,
    held_out,
    mean_loss,
    model_output_loss,
    move_to,
    output_cosine,
    output_distortion,
    paired_standard_error,
    perplexity,
)
from .space import Candidate, Reference, SearchResult, SearchSpace

__all__ = [
    "ConfigurationSearch",
    "Lockstep",
    "evaluate_plan",
    "measured_bits",
    "Measurement",
    "QualityMetric",
    "accuracy",
    "device_of",
    "held_out",
    "mean_loss",
    "model_output_loss",
    "move_to",
    "output_cosine",
    "output_distortion",
    "paired_standard_error",
    "perplexity",
    "Candidate",
    "Reference",
    "SearchResult",
    "SearchSpace",
]
