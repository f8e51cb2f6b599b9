"""The conformance suites, one mixin class per capability area.

Subclass one (or several) with ``backend_target`` set to run it on a
backend; see ``kvt_conformance.fixtures.BackendFixtures``.
"""

from .completion import CompletionTests
from .concurrency import ConcurrencyTests
from .descriptors import DescriptorTests
from .engine import EngineScenarioTests
from .errors import ErrorTests
from .faults import FaultTests
from .metadata import MetadataTests
from .notifications import NotificationTests
from .registration import RegistrationTests
from .transfers import TransferTests

#: every suite, in report order
ALL_SUITES = (RegistrationTests, DescriptorTests, TransferTests, CompletionTests, NotificationTests,
              MetadataTests, ErrorTests, FaultTests, ConcurrencyTests, EngineScenarioTests)
#: capability areas, in report order
AREAS = tuple(s.area for s in ALL_SUITES)

__all__ = [s.__name__ for s in ALL_SUITES] + ["ALL_SUITES", "AREAS"]
