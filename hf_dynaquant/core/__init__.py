"""Numeric primitives: numpy/torch only, no Hugging Face imports, no I/O."""
