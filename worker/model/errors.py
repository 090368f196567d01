"""Errors raised while loading a model folder: a missing file, or a model we cannot run."""

from __future__ import annotations


class ModelFileNotFoundError(FileNotFoundError):
    """A file the model folder must hold is missing; the message names it."""


class UnsupportedModelError(ValueError):
    """The folder holds a model (architecture, rope type, option) this worker cannot run."""
