"""kvt's conformance suite, every area, on the nixl backend."""

from kvt_conformance import (CompletionTests, ConcurrencyTests, DescriptorTests, EngineScenarioTests,
                             ErrorTests, FaultTests, MetadataTests, NotificationTests, RegistrationTests,
                             TransferTests)


class Nixl:
    backend_target = "nixl"


class TestRegistration(Nixl, RegistrationTests):
    pass


class TestDescriptors(Nixl, DescriptorTests):
    pass


class TestTransfers(Nixl, TransferTests):
    pass


class TestCompletion(Nixl, CompletionTests):
    pass


class TestNotifications(Nixl, NotificationTests):
    pass


class TestMetadata(Nixl, MetadataTests):
    pass


class TestErrors(Nixl, ErrorTests):
    pass


class TestFaults(Nixl, FaultTests):
    pass


class TestConcurrency(Nixl, ConcurrencyTests):
    pass


class TestEngineScenario(Nixl, EngineScenarioTests):
    pass
