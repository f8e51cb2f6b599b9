"""kvt's conformance suite: prove that a backend keeps the protocol.

Two ways to run the same tests::

    pytest --pyargs kvt_conformance --kvt-backend=NAME [--kvt-options=JSON]
    kvt conformance NAME                     # the same, plus a table per area

or, in a plugin's own tests, subclass ``ConformanceTests`` once (every
suite; override a test there to mark it xfail with a reason) or any single
suite::

    from kvt_conformance import ConformanceTests

    class TestMyBackend(ConformanceTests):
        backend_target = "mybackend"         # entry-point name or Backend subclass

Each test states the capabilities it needs (``requires``) and is skipped,
with the reason, where the backend does not declare them ("not declared")
or this machine lacks them ("declared, unavailable here").

Importing this package is cheap (the pytest plugin imports it in every
pytest run): the suites load on first use of their names.
"""

import importlib

import pytest

# the suites live outside test files; rewrite their asserts for readable failures
pytest.register_assert_rewrite("kvt_conformance.suites", "kvt_conformance.fixtures")

_LAZY = {
    "BackendFixtures": "fixtures", "requires": "requirements", "NOT_DECLARED": "requirements",
    "UNAVAILABLE": "requirements", "ALL_SUITES": "suites", "AREAS": "suites",
    "RegistrationTests": "suites", "DescriptorTests": "suites", "TransferTests": "suites",
    "CompletionTests": "suites", "NotificationTests": "suites", "MetadataTests": "suites",
    "ErrorTests": "suites", "FaultTests": "suites", "ConcurrencyTests": "suites",
    "EngineScenarioTests": "suites", "OwnerCheckTests": "suites", "CrossHostTests": "suites",
    "ConformanceTests": "suites",
}

__all__ = list(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvt_conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
