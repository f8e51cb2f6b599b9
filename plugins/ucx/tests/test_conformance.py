"""kvt's conformance suite on the ucx backend (peers in separate processes)."""

import kvt_conformance as kc


class Ucx:
    backend_target = "ucx"
    backend_options = {"timeout": 5.0, "ucx": {"NET_DEVICES": "lo"}}  # UCX's TCP on loopback only


class TestRegistration(Ucx, kc.RegistrationTests):
    pass


class TestDescriptors(Ucx, kc.DescriptorTests):
    pass


class TestTransfers(Ucx, kc.TransferTests):
    pass


class TestCompletion(Ucx, kc.CompletionTests):
    pass


class TestNotifications(Ucx, kc.NotificationTests):
    pass


class TestMetadata(Ucx, kc.MetadataTests):
    pass


class TestErrors(Ucx, kc.ErrorTests):
    pass


class TestFaults(Ucx, kc.FaultTests):
    pass


class TestConcurrency(Ucx, kc.ConcurrencyTests):
    pass


class TestEngineScenario(Ucx, kc.EngineScenarioTests):
    pass
