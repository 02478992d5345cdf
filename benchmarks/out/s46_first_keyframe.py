"""Where session 46's probes (delta_choice_s46, key_sizes_s46, key_util_s46) start alike:
bench_scale's GPT-2 at ``SIZE`` (environment, default 124M) after one AdamW step, and a
compressor that has written its first keyframe (step 1) to a store in a new folder under
/dev/shm."""

import os
import sys
import tempfile

sys.path.insert(0, "/work/main/benchmarks")
import torch  # noqa: E402
from bench_scale import CONFIG, SIZES, fresh, train_step  # noqa: E402
from transformers import GPT2Config  # noqa: E402

from hf_dynaquant import Compressor  # noqa: E402


def first_keyframe():
    """``(model, optimizer, folder, compressor)`` once that keyframe is written."""
    torch.manual_seed(0)
    model, opt = fresh(GPT2Config(**SIZES[os.environ.get("SIZE", "124M")]))
    train_step(model, opt, 0)
    folder = tempfile.mkdtemp(dir="/dev/shm")
    compressor = Compressor(model, os.path.join(folder, "s"), CONFIG, optimizer=opt)
    compressor.compress(1)
    return model, opt, folder, compressor
