"""kvt backend ``nixl``: kvt's protocol on NIXL agents (UCX plugin)."""

from .backend import NixlBackend

__all__ = ["NixlBackend"]
