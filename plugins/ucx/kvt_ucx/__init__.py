"""kvt-ucx: the ``ucx`` kvt backend, one-sided READ/WRITE over raw UCX (ucxx)."""

from .backend import UcxBackend

__all__ = ["UcxBackend"]
