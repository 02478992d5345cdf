"""Nothing warns a user about what is not theirs to fix: the demo corpus, the package build."""

from __future__ import annotations

import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from hf_dynaquant.pretrained.corpus import docstring_corpus

ROOT = Path(__file__).resolve().parents[1]


def test_docstring_corpus_does_not_warn() -> None:
    docstring_corpus.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # typing.io / typing.re are deprecated aliases the walk reads
        assert len(docstring_corpus()) > 500_000


@pytest.mark.slow
def test_wheel_builds_the_optional_extension_without_warnings(tmp_path: Path) -> None:
    """The C kernels are built (setup.py, ``optional=True``) without setuptools' experimental
    ``ext-modules`` warning; the build uses this environment's setuptools (no download)."""
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(tmp_path)]
    cmd.append(str(ROOT))
    build = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    log = build.stdout + build.stderr
    assert "experimental" not in log and "BuildBackendWarning" not in log
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("hf_dynaquant/core/_kernels") and n.endswith(".so") for n in names)
