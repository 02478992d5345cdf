"""The optional C extension (everything else is in pyproject.toml).

``hf_dynaquant.core._kernels`` holds single-pass kernels for the lossless codec, the sketch and
the quantizer (C sources in ``hf_dynaquant/core/csrc/``, one file per kernel family);
``optional=True`` lets the install go on without a C compiler, and the numpy references are used
then (see :mod:`hf_dynaquant.core.kernels`). (setuptools' ``ext-modules`` key in pyproject.toml
would say the same but is still experimental and warns on every build.)
"""

from setuptools import Extension, setup

CSRC = "hf_dynaquant/core/csrc"

setup(
    ext_modules=[
        Extension(
            "hf_dynaquant.core._kernels",
            sources=[f"{CSRC}/{name}.c" for name in ("module", "bitplanes", "sketch", "partition", "moments")],
            depends=[f"{CSRC}/kernels.h"],
            optional=True,
        ),
    ]
)
