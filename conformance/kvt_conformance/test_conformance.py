"""What ``pytest --pyargs kvt_conformance --kvt-backend=NAME`` runs: every
suite (TestRegistration, TestTransfers, ...), against the backend named on
the command line."""

from kvt_conformance import ConformanceTests


class Test(ConformanceTests):
    pass
