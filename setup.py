"""The optional C extension (everything else is in pyproject.toml).

``hf_dynaquant.core._bitplanes`` holds single-pass kernels for the lossless codec, the sketch and
the quantizer; ``optional=True`` lets the install go on without a C compiler, and the numpy
reference in :mod:`hf_dynaquant.core.bitplanes` is used then. (setuptools' ``ext-modules`` key in
pyproject.toml would say the same but is still experimental and warns on every build.)
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("hf_dynaquant.core._bitplanes", sources=["hf_dynaquant/core/_bitplanes.c"], optional=True),
    ]
)
