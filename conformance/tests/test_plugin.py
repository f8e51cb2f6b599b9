"""The pytest plugin: inert unless asked, a usage error for a bad backend
or options, the report header, skip reasons, and the JSON report."""

from __future__ import annotations

import json

import pytest

BACKEND_MODULES = ("kvt", "kvt_host", "kvt_example", "kvt_nixl", "kvt_ucx", "nixl", "ucxx", "numpy", "zmq")


def test_inert_in_runs_that_do_not_ask_for_it(pytester):
    pytester.makepyfile(f"""
        import sys

        def test_nothing_loaded():
            assert "kvt_conformance.plugin" in sys.modules  # loaded through its entry point...
            loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({BACKEND_MODULES!r}))
            assert loaded == []  # ...without importing kvt, a backend or their dependencies
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*kvt backend:*")


def test_pyargs_without_a_backend_skips_saying_why(pytester):
    result = pytester.runpytest_subprocess("--pyargs", "kvt_conformance", "-p", "no:cacheprovider",
                                           "-k", "TestRegistration", "-rs")
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0 and "passed" not in outcomes and "failed" not in outcomes
    result.stdout.fnmatch_lines(["*no backend to test: pass --kvt-backend=NAME*"])


@pytest.mark.parametrize("args, message", [
    (["--kvt-backend=no-such-backend"], "*--kvt-backend=no-such-backend: no kvt backend named 'no-such-backend'*"),
    (["--kvt-backend=example", "--kvt-options=[1]"], "*--kvt-options must be a JSON object, got list*"),
    (["--kvt-backend=example", "--kvt-options={oops"], "*--kvt-options must be a JSON object*"),
])
def test_bad_backend_or_options_is_a_usage_error(pytester, args, message):
    result = pytester.runpytest_subprocess("--pyargs", "kvt_conformance", "-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_header_names_backend_version_capabilities_and_options(pytester):
    result = pytester.runpytest_subprocess("--pyargs", "kvt_conformance", "-p", "no:cacheprovider",
                                           "--kvt-backend=example", '--kvt-options={"timeout": 7}',
                                           "-k", "test_zero_length_region")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "kvt backend: example (kvt-example 0.1.0, ep:example); declares memory DRAM, ops READ WRITE, "
        "notifications, local, max_notif_bytes=65536, owner_check=server; options {'timeout': 7}; "
        "cross_host: not declared: not tested; DRAM: declared, tested"])


def test_skip_reasons_tell_not_declared_from_unavailable_here(pytester):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: VRAM is available here")
    pytester.makepyfile("""
        from kvt.types import Capabilities, MemKind, Op
        from kvt_example.backend import ExampleBackend
        import kvt_conformance as kc

        class ClaimsVram(ExampleBackend):
            '''Test double: declares VRAM (which the test never gets to use here).'''
            capabilities = Capabilities(mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), ops=frozenset(Op),
                                        notifications=True, local=True, remote=False, cross_host=False,
                                        max_notif_bytes=64 * 1024, cross_host_options={}, owner_check="server")

        class TestKinds(kc.RegistrationTests):
            backend_target = ClaimsVram
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", "-k", "test_register_and_deregister")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines_random([
        "*declared, unavailable here: VRAM: no CUDA device (torch.cuda.is_available() is False)",
        "*not declared: ClaimsVram does not declare DEVICE memory (Capabilities.mem_kinds)"])


def test_json_report_areas_reasons_and_overridden_tests(pytester):
    """A plugin's subclass that overrides a test (here to xfail it) keeps the test's area."""
    pytester.makepyfile("""
        import pytest
        import kvt_conformance as kc

        class TestMine(kc.RegistrationTests):
            backend_target = "example"

            @pytest.mark.xfail(reason="known gap, tracked upstream", strict=True)
            def test_double_deregister(self, *args, **kwargs):
                raise AssertionError("pretend this backend gets it wrong")

        class TestMyNotifications(kc.NotificationTests):
            backend_target = "example"
    """)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--kvt-report={report}",
                                           "-k", "double_deregister or zero_length or standalone or register_and_deregister")
    assert result.ret == 0
    data = json.loads(report.read_text())
    tests = {t["nodeid"].split("::", 1)[1]: t for t in data["tests"]}
    assert tests["TestMine::test_double_deregister"] | {"duration": 0} == {
        "nodeid": "test_json_report_areas_reasons_and_overridden_tests.py::TestMine::test_double_deregister",
        "area": "registration", "outcome": "xfailed", "reason": "known gap, tracked upstream", "duration": 0}
    assert tests["TestMine::test_zero_length_region"]["outcome"] == "passed"
    assert tests["TestMyNotifications::test_standalone"]["area"] == "notifications"
    vram = tests["TestMine::test_register_and_deregister[VRAM]"]
    assert vram["outcome"] == "skipped" and vram["reason"].startswith("not declared: ExampleBackend")
    assert data["areas"]["registration"] == {"passed": 2, "failed": 0, "skipped": 3}
    assert data["areas"]["notifications"] == {"passed": 1, "failed": 0, "skipped": 0}
    assert [b["backend"] for b in data["backends"]] == ["example"]
    assert data["backends"][0]["capabilities"]["mem_kinds"] == ["DRAM"]
