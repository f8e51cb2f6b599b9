"""The conformance suites, one mixin class per capability area.

Subclass one (or several) with ``backend_target`` set to run it on a
backend; see ``kvt_conformance.fixtures.BackendFixtures``.
"""

import sys
from typing import Any

from .completion import CompletionTests
from .concurrency import ConcurrencyTests
from .crosshost import CrossHostTests
from .descriptors import DescriptorTests
from .engine import EngineScenarioTests
from .errors import ErrorTests
from .faults import FaultTests
from .metadata import MetadataTests
from .notifications import NotificationTests
from .ownership import OwnerCheckTests
from .registration import RegistrationTests
from .transfers import TransferTests

#: every suite, in report order
ALL_SUITES = (RegistrationTests, DescriptorTests, TransferTests, CompletionTests, NotificationTests,
              OwnerCheckTests, MetadataTests, ErrorTests, FaultTests, ConcurrencyTests, CrossHostTests,
              EngineScenarioTests)
#: capability areas, in report order
AREAS = tuple(s.area for s in ALL_SUITES)



class ConformanceTests:
    """Every suite at once, for one backend.  A plugin's whole test module::

        from kvt_conformance import ConformanceTests

        class TestMyBackend(ConformanceTests):
            backend_target = "mybackend"        # entry-point name, or the Backend subclass
            backend_options = {"timeout": 5}    # optional

    Subclassing defines, next to the subclass in its module, one pytest class
    per suite (``TestMyBackendRegistration``, ``TestMyBackendTransfers``...),
    each with the subclass's attributes.  A test method defined on the
    subclass (say, to mark one test xfail with a reason) replaces that test
    in the suites that have it, and nowhere else.
    """

    backend_target: Any = None
    backend_options: Any = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        module = sys.modules[cls.__module__]
        own = {k: v for k, v in vars(cls).items() if not k.startswith("__")}
        for suite in ALL_SUITES:
            name = cls.__name__ + suite.__name__.removesuffix("Tests")
            body = {k: v for k, v in own.items() if not k.startswith("test") or hasattr(suite, k)}
            setattr(module, name, type(name, (suite,), {**body, "__module__": cls.__module__,
                                                        "__qualname__": name}))


__all__ = [s.__name__ for s in ALL_SUITES] + ["ALL_SUITES", "AREAS", "ConformanceTests"]
