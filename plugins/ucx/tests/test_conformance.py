"""kvt's conformance suite, every suite, on the ucx backend, peers in
separate processes (what `kvt conformance ucx` runs; CI runs it here instead)."""

from kvt_conformance import ConformanceTests


class TestUcx(ConformanceTests):
    backend_target = "ucx"
    backend_options = {"timeout": 5.0, "ucx": {"NET_DEVICES": "lo"}}  # UCX's TCP on loopback only
