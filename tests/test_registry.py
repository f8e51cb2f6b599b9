"""Backend discovery through real entry-point metadata.

tests/fixtures/plugins holds a never-installed distribution
(kvt_fake_backends-0.3.0.dist-info) whose entry points cover every failure
mode; putting the directory on sys.path makes importlib.metadata (and so
stevedore) discover it exactly as an installed plugin.
"""

import re
import sys
from pathlib import Path

import pytest
from stevedore import ExtensionManager

from kvt import (Availability, Backend, BackendLoadError, BackendNotFound, BackendUnavailable, ConfigError,
                 MemKind, Op, registry)

PLUGINS = Path(__file__).parent / "fixtures" / "plugins"


def _fake_modules():
    return [m for m in sys.modules if m.split(".")[0] == "kvt_fake_backends"]


@pytest.fixture
def fake_plugins(monkeypatch):
    """Fixture plugins discoverable, none of their modules imported yet."""
    for mod in _fake_modules():
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_listing_reads_metadata_without_importing_plugins(fake_plugins):
    infos = {i.name: i for i in registry.list_backends() if i.dist == "kvt-fake-backends"}
    # `broken` raises on import, so listing it at all shows nothing was imported
    assert set(infos) == {"fake", "unusable", "failinginit", "notabackend", "missingattr", "broken", "dup",
                          "badavail", "badcaps"}
    assert infos["fake"] == registry.BackendInfo("fake", "kvt_fake_backends.doubles:FakeBackend",
                                                 "kvt-fake-backends", "0.3.0")
    assert _fake_modules() == []


def test_listing_is_sorted_and_includes_installed_host():
    infos = registry.list_backends()
    assert [i.name for i in infos] == sorted(i.name for i in infos)
    host = next(i for i in infos if i.name == "host")
    assert (host.dist, host.value) == ("kvt-host", "kvt_host.backend:HostBackend")


def test_load_returns_the_backend_class(fake_plugins):
    from kvt_fake_backends.doubles import FakeBackend  # noqa: I001  (importable once on sys.path)
    assert registry.load_backend("fake") is FakeBackend


def test_load_sees_plugins_added_after_an_earlier_load(monkeypatch):
    # stevedore caches a group's entry points per process; a plugin that
    # appears later (here: its directory joins sys.path) must still load
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})  # as in a fresh process
    assert issubclass(registry.load_backend("host"), Backend)
    monkeypatch.syspath_prepend(str(PLUGINS))
    assert registry.load_backend("fake").__name__ == "FakeBackend"


def test_unknown_name_lists_installed_backends(fake_plugins):
    with pytest.raises(BackendNotFound) as e:
        registry.load_backend("fakee")
    msg = str(e.value)
    assert "'fakee'" in msg and "Did you mean 'fake'?" in msg
    installed = msg.split("Installed backends: ")[1].split(".")[0].split(", ")
    assert {"broken", "fake", "host", "unusable"} <= set(installed) and installed == sorted(installed)
    assert isinstance(e.value, LookupError)


def test_an_unknown_name_says_where_it_was_set(tmp_path):
    # before: the same message whether the name came from KVT_BACKEND, a file or code
    from kvt import Agent, Config, load_config

    conf = tmp_path / "kvt.toml"
    conf.write_text('backend = "hots"\n')
    for config, source in ((load_config(env={"KVT_BACKEND": "hots"}), "environment variable KVT_BACKEND"),
                           (load_config(env={"KVT_CONFIG": str(conf)}), f"{conf} (from KVT_CONFIG)"),
                           (load_config(backend="hots", env={}), "load_config() arguments"),
                           (Config(backend="hots"), "Config(...)")):
        with pytest.raises(BackendNotFound, match=rf"^no kvt backend named 'hots' \(set by {re.escape(source)}\)\. "
                                                  "Did you mean 'host'"):
            Agent("a", config=config)


def test_known_but_not_installed_names_the_package(monkeypatch):
    monkeypatch.setitem(registry.KNOWN, "fakeknown", "kvt-fakeknown")
    with pytest.raises(BackendNotFound) as e:
        registry.load_backend("fakeknown")
    msg = str(e.value)
    assert "not installed" in msg and "'kvt-fakeknown'" in msg
    assert "pip install -e plugins/fakeknown" in msg and "host" in msg


def test_known_distribution_installed_without_its_entry_point(fake_plugins, monkeypatch):
    monkeypatch.setitem(registry.KNOWN, "ghost", "kvt-fake-backends")
    with pytest.raises(BackendNotFound, match=r"kvt-fake-backends 0\.3\.0 is installed but declares no "
                                              r"'kvt\.backends' entry point 'ghost'; reinstall"):
        registry.load_backend("ghost")


def test_every_known_backend_has_an_install_hint():
    assert set(registry.KNOWN) >= {"host", "nixl", "ucx", "example"}
    for name in registry.KNOWN:
        assert registry.install_hint(name) == f"pip install -e plugins/{name}"


def test_plugin_that_fails_to_import_says_why(fake_plugins):
    with pytest.raises(BackendLoadError) as e:
        registry.load_backend("broken")
    msg = str(e.value)
    assert "'broken'" in msg and "kvt-fake-backends 0.3.0" in msg
    assert "No module named 'kvt_fake_missing_native_dep'" in msg
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    assert isinstance(e.value, ImportError)


def test_entry_point_to_missing_attribute(fake_plugins):
    with pytest.raises(BackendLoadError, match="has no attribute 'NoSuchClass'") as e:
        registry.load_backend("missingattr")
    assert isinstance(e.value.__cause__, AttributeError)


def test_entry_point_that_is_not_a_backend(fake_plugins):
    with pytest.raises(BackendLoadError, match=r"NotABackend.*not a subclass of kvt\.Backend"):
        registry.load_backend("notabackend")


def test_post_path_must_be_text_or_none(fake_plugins, monkeypatch):
    from kvt_fake_backends.doubles import FakeBackend

    monkeypatch.setattr(FakeBackend, "post_path", object())  # kvt backends --json must stay valid JSON
    with pytest.raises(BackendLoadError, match=r"FakeBackend\.post_path is object, not None or a str"):
        registry.load_backend("fake")
    assert not registry.probe("fake").usable
    monkeypatch.setattr(FakeBackend, "post_path", "python (no compiler)")
    assert registry.probe("fake").post_path == "python (no compiler)"


def test_capabilities_must_be_declared_as_capabilities(fake_plugins):
    with pytest.raises(BackendLoadError, match=r"DictCapabilitiesFakeBackend\.capabilities is dict, "
                                               r"not a kvt\.Capabilities"):
        registry.load_backend("badcaps")


def test_name_declared_by_two_distributions(fake_plugins):
    with pytest.raises(BackendLoadError, match=r"'dup' is declared by several distributions: "
                                               r"kvt-fake-backends 0\.3\.0 .*, kvt-fake-dup 1\.0"):
        registry.load_backend("dup")


def test_probe_reports_capabilities_and_availability(fake_plugins):
    ok = registry.probe("fake")
    assert ok.usable and ok.info.name == "fake"
    assert ok.capabilities.mem_kinds == {MemKind.DRAM, MemKind.VRAM}
    assert ok.capabilities.ops == {Op.READ} and not ok.capabilities.cross_host
    no = registry.probe("unusable")
    assert no.availability == Availability(False, "needs the fake interconnect, which this machine lacks")


def test_probe_reports_a_crashing_availability_check(fake_plugins):
    status = registry.probe("badavail")
    assert status.availability == Availability(
        False, "RaisingAvailabilityFakeBackend.availability() raised RuntimeError: probe of /dev/fake0 crashed")
    with pytest.raises(BackendUnavailable, match="probe of /dev/fake0 crashed"):
        registry.create_backend("badavail", "a")


def test_probe_reports_a_broken_plugin_instead_of_raising(fake_plugins):
    status = registry.probe("broken")
    assert not status.usable and status.capabilities is None
    assert "kvt_fake_missing_native_dep" in status.availability.reason
    with pytest.raises(BackendNotFound):
        registry.probe("nosuch")


def test_create_backend_passes_agent_name_and_options(fake_plugins):
    b = registry.create_backend("fake", "agent-a", {"timeout": 3})
    assert type(b).__name__ == "FakeBackend"
    assert (b.agent_name, b.options, b.timeout) == ("agent-a", {"timeout": 3}, 3.0)


def test_a_backend_without_option_names_takes_every_key(fake_plugins):
    b = registry.create_backend("fake", "a", {"anything": 1, "timeout": 3})
    assert type(b).option_names is None and b.options == {"anything": 1, "timeout": 3}


def test_create_unusable_backend_raises_with_reason(fake_plugins):
    with pytest.raises(BackendUnavailable, match="cannot run on this machine: needs the fake interconnect"):
        registry.create_backend("unusable", "a")


def test_create_maps_native_constructor_errors(fake_plugins):
    with pytest.raises(BackendUnavailable, match="failed to start: OSError: fake device /dev/fake0 is busy") as e:
        registry.create_backend("failinginit", "a")
    assert isinstance(e.value.__cause__, OSError)


@pytest.mark.parametrize("name", [None, 5, b"host", ["host"]])
def test_a_name_that_is_not_a_str_is_not_found_and_lists_installed(name):
    with pytest.raises(BackendNotFound, match="must be a str") as e:
        registry.load_backend(name)
    assert "Installed backends:" in str(e.value) and "host" in str(e.value)
    with pytest.raises(BackendNotFound, match="must be a str"):
        registry.probe(name)


@pytest.mark.parametrize("options", [[1], "timeout=1", 5])
def test_options_that_are_not_a_mapping_are_a_config_error(options):
    with pytest.raises(ConfigError, match="must be a mapping"):
        registry.create_backend("host", "a", options)
