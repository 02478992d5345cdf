"""Integrations with the Hugging Face libraries (kept apart from the numeric core)."""
