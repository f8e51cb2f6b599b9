"""kvt.extensions: each compiled part in use, or its pure-Python twin with
the reason an operator reads in ``kvt backends``."""

import os

from kvt import agent, extensions, memcopy


def test_a_built_extension_is_in_use_unless_kvt_native_0():
    mod, why = extensions.load("kvt._copy", "kvt", "pure-Python fallback")
    if os.environ.get("KVT_NATIVE", "1") == "0":
        assert (mod, why) == (None, "KVT_NATIVE=0 forces the pure-Python fallback")
        assert not extensions.ENABLED and memcopy.ENGINE == agent.POST_PATH == "python"
    else:
        assert mod is not None and mod.__name__ == "kvt._copy" and why == "C extension kvt._copy"
        assert extensions.summary(mod, why) == "native (C extension kvt._copy)"


def test_kvt_native_0_turns_off_every_extension(monkeypatch):
    monkeypatch.setattr(extensions, "ENABLED", False)
    assert extensions.load("kvt._copy", "kvt", "twin") == (None, "KVT_NATIVE=0 forces the twin")


def test_a_missing_extension_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(extensions, "ENABLED", True)
    mod, why = extensions.load("kvt._not_built", "kvt-x", "twin")
    assert mod is None and why.startswith("kvt._not_built did not load (No module named 'kvt._not_built')")
    assert why.endswith("reinstall kvt-x with gcc and the Python headers present")
    assert extensions.summary(mod, why) == f"python ({why})"


def test_a_missing_prerequisite_keeps_the_twin(monkeypatch):
    monkeypatch.setattr(extensions, "ENABLED", True)
    assert extensions.load("kvt._copy", "kvt", "twin", "kvt's native copy engine (off)") == (
        None, "kvt._copy needs kvt's native copy engine (off)")
