"""The optional C extension and the model-card template (everything else is in pyproject.toml).

``hf_dynaquant.core._kernels`` holds single-pass kernels for the lossless codec, the sketch and
the quantizer (C sources in ``hf_dynaquant/core/csrc/``, one file per kernel family);
``optional=True`` lets the install go on without a C compiler, and the numpy references are used
then (see :mod:`hf_dynaquant.core.kernels`). (setuptools' ``ext-modules`` key in pyproject.toml
would say the same but is still experimental and warns on every build.)

The model-card template of Hub snapshots lives in the top-level ``model_cards/`` with the cards
made from it (one source); the build copies it into the package (``hf_dynaquant/model_cards/``)
so that wheels and ``pip install .`` carry it. A source tree, and so an editable install, reads it
where it is (:func:`hf_dynaquant.integrations.hub.card_template`). MANIFEST.in puts it in the sdist.
"""

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

CSRC = "hf_dynaquant/core/csrc"
TEMPLATE = "model_cards/dynaquant.md"


class BuildPyWithTemplate(build_py):
    """``build_py`` that also puts the model-card template into the built package."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "hf_dynaquant" / TEMPLATE
        self.mkpath(str(target.parent))
        self.copy_file(TEMPLATE, str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / "hf_dynaquant" / TEMPLATE)]


setup(
    cmdclass={"build_py": BuildPyWithTemplate},
    ext_modules=[
        Extension(
            "hf_dynaquant.core._kernels",
            sources=[
                f"{CSRC}/{name}.c"
                for name in (
                    "module", "bitplanes", "sketch", "partition", "rounding", "moments", "delta", "ans", "kmeans", "trellis",
                    "varint", "factored",
                )
            ],
            depends=[f"{CSRC}/kernels.h"],
            # sqrt, log and exp never set errno (nothing reads it), so sqrtf vectorises; the
            # OpenMP simd pragmas (no OpenMP runtime) let marked reductions vectorise; a * b + c is
            # never contracted into one rounding (an FMA), so every build gives the same results;
            # a generic vector wider than its target's registers, which GCC takes apart a byte at
            # a time (30x slower), is warned of
            extra_compile_args=["-fno-math-errno", "-fopenmp-simd", "-ffp-contract=off", "-Wvector-operation-performance"],
            optional=True,
        ),
    ],
)
