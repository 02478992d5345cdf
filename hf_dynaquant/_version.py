"""The package version, in a module of its own: the store records it in every manifest and the
CLI prints it, and both must read it without importing the package root (which imports them).
pyproject.toml reads it from here (``[tool.setuptools.dynamic]``)."""

__version__ = "0.1.0"
