"""What ``pytest --pyargs kvt_conformance --kvt-backend=NAME`` runs: every
suite, against the backend named on the command line."""

from kvt_conformance import (CompletionTests, ConcurrencyTests, DescriptorTests, EngineScenarioTests,
                             ErrorTests, FaultTests, MetadataTests, NotificationTests, RegistrationTests,
                             TransferTests)


class TestRegistration(RegistrationTests):
    pass


class TestDescriptors(DescriptorTests):
    pass


class TestTransfers(TransferTests):
    pass


class TestCompletion(CompletionTests):
    pass


class TestNotifications(NotificationTests):
    pass


class TestMetadata(MetadataTests):
    pass


class TestErrors(ErrorTests):
    pass


class TestFaults(FaultTests):
    pass


class TestConcurrency(ConcurrencyTests):
    pass


class TestEngineScenario(EngineScenarioTests):
    pass
