"""Pre-trained models: compressing a model folder or Hub snapshot once, for publishing.

:mod:`~hf_dynaquant.pretrained.folder` writes and reads compressed model folders,
:mod:`~hf_dynaquant.pretrained.calibration` searches their configuration on calibration text
(:mod:`~hf_dynaquant.pretrained.corpus`), and :mod:`~hf_dynaquant.pretrained.weights` finds the
pre-trained weights a fine-tune's checkpoints are coded as residuals against.
:mod:`~hf_dynaquant.pretrained.transfer` checks that fine-tuning from a snapshot lands where
fine-tuning from the original does.
"""

from .weights import PretrainedWeights, resolve_pretrained

__all__ = ["PretrainedWeights", "resolve_pretrained"]
