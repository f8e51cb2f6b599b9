"""kvt's conformance suite, every suite, on the nixl backend (what `kvt
conformance nixl` runs; CI runs it here instead)."""

from kvt_conformance import ConformanceTests


class TestNixl(ConformanceTests):
    backend_target = "nixl"
