"""Typed errors raised by the engine. The CLI maps any :class:`EngineError` to exit code 2."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose (bad checkpoint, bad request)."""


class CheckpointError(EngineError):
    """A checkpoint folder is missing files, has corrupt files, or uses an unsupported architecture."""


class PromptTooLongError(EngineError):
    """A sequence would extend beyond the model's maximum context length."""


class InvalidRequestError(EngineError):
    """A request is malformed: empty prompt, token id outside the vocabulary, short block table, ..."""
