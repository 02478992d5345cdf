"""Other methods' codecs, for side-by-side comparisons with DynaQuant (issue "Peers side by side").

Each peer follows its paper and shares the core primitives and the store with our own codecs; it
is registered by name, so ``hf-dynaquant compress --codec <name>`` and
``compress_folder(codec=<name>)`` use it and any reader decodes it.

* ``nf4`` (:mod:`.nf4`): QLoRA's 4-bit NormalFloat, blocks of 64 values with an absmax scale, the
  quantization people publish pre-trained models with (bitsandbytes).
* ``cnr`` (:mod:`.cnr`): Check-N-Run's row-wise uniform quantizer with a greedy clipping-range
  search (FBGEMM's ``embedding_bag_4bit_prepack(optimized_qparams=True)``).
* ``gobo`` (:mod:`.gobo`): GOBO's Gaussian outliers kept exact, the rest clustered to a few
  centroids by Lloyd iterations that stop on the L1 error.
* ``qd`` (:mod:`.qd`): QD-Compressor's min-max uniform quantizer at per-layer bit widths from the
  weights' entropy (:func:`qd_bits`), a cyclic delta of the codes between checkpoints, LZMA.
* ``jointsq`` (:mod:`.jointsq`): JointSQ's 0/2/4/8 bits per value by a greedy multiple-choice
  knapsack under a budget of bits (0 bits: pruned).
* ``excp`` (:mod:`.excp`): ExCP's weight-momentum joint shrinking of the residual between
  checkpoints and of Adam's moments, then K-means (:func:`excp_state` writes a checkpoint).
"""

from .cnr import CNRCodec
from .excp import ExCPCodec, excp_shrink, excp_state
from .gobo import GOBOCodec
from .jointsq import JointSQCodec
from .nf4 import NF4Codec
from .qd import QDCodec, qd_bits

__all__ = [
    "CNRCodec",
    "ExCPCodec",
    "GOBOCodec",
    "JointSQCodec",
    "NF4Codec",
    "QDCodec",
    "excp_shrink",
    "excp_state",
    "qd_bits",
]
