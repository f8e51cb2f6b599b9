"""kvt.memory's page policy: huge pages when the system allows, a clean
fallback to 4 KiB pages when it does not, and the reason either way."""

from __future__ import annotations

import numpy as np
import pytest

from kvt import memory


@pytest.fixture
def system(tmp_path, monkeypatch):
    """Point kvt.memory at fake /proc/meminfo and shmem_enabled files."""
    meminfo, thp = tmp_path / "meminfo", tmp_path / "shmem_enabled"
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    monkeypatch.setattr(memory, "SHMEM_THP", str(thp))
    monkeypatch.delenv("KVT_HUGEPAGES", raising=False)

    def set_(free_pages: int, shmem: str) -> None:
        meminfo.write_text(f"MemTotal: 1000 kB\nHugePages_Total: {free_pages}\n"
                           f"HugePages_Free: {free_pages}\nHugepagesize: 2048 kB\n")
        thp.write_text(" ".join(f"[{w}]" if w == shmem else w
                                for w in ("always", "within_size", "advise", "never", "deny", "force")))
    return set_


@pytest.mark.parametrize("free, shmem, kind", [
    (0, "never", "4k"), (0, "deny", "4k"), (0, "advise", "thp"), (0, "always", "thp"),
    (512, "never", "hugetlb"), (1, "never", "4k"),  # one 2 MiB page is too few for 1 GiB
])
def test_policy_follows_the_system(system, free, shmem, kind):
    system(free, shmem)
    got, reason = memory.page_policy(1 << 30)
    assert got == kind
    assert ("never" in reason or "deny" in reason) if kind == "4k" else reason


def test_env_switch_forces_small_pages(system, monkeypatch):
    system(512, "always")
    monkeypatch.setenv("KVT_HUGEPAGES", "0")
    assert memory.page_policy() == ("4k", "KVT_HUGEPAGES=0")


def _usable(arr: np.ndarray) -> None:
    arr[:] = 3
    assert int(arr.sum()) == 3 * arr.size
    assert len(memory.segments_of(memory.Descs.from_buffers([arr]))) == 1


def test_thp_segments_are_advised_and_rounded(system):
    system(0, "advise")
    arr = memory.empty(3 << 20)
    assert memory.page_kind(arr) == "thp" and arr.nbytes == 3 << 20
    (seg,) = memory.segments_of(memory.Descs.from_buffers([arr])).tolist()
    assert seg[1] == 4 << 20  # whole 2 MiB pages
    _usable(arr)


def test_hugetlb_refused_falls_back_cleanly(system):
    """The fake meminfo promises hugetlb pages; if the kernel has none, the
    segment still comes back usable, on the next kind down."""
    real = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("HugePages_Free")))
    system(4096, "never")
    arr = memory.empty(2 << 20)
    assert memory.page_kind(arr) == ("hugetlb" if real else "4k")
    _usable(arr)


# -- malformed or impossible requests are refused before anything is mapped --

def test_empty_refuses_an_unknown_dtype():
    from kvt.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="not a numpy dtype"):
        memory.empty(10, "nope")
    with pytest.raises(InvalidArgument, match="Python objects"):
        memory.empty(10, object)


def test_empty_refuses_more_than_physical_memory(monkeypatch):
    """A pre-faulted segment larger than RAM would get the process OOM-killed."""
    import os

    from kvt.errors import InvalidArgument

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def no_mapping(*_):  # only sizes that must be refused are tried here: nothing may be mapped
        raise AssertionError("empty() mapped a segment larger than physical memory")

    monkeypatch.setattr(memory, "_map", no_mapping)
    for nbytes in (ram + 1, 2**40 if 2**40 > ram else 2 * ram):
        with pytest.raises(InvalidArgument, match="physical memory"):
            memory.empty(nbytes)
    with pytest.raises(InvalidArgument, match="physical memory"):
        memory.empty((ram // 8 + 1,), np.float64)


def test_wrong_arguments_are_invalid_argument():
    from kvt.errors import InvalidArgument

    for call, says in ((lambda: memory.page_kind(5), "numpy array or a torch tensor"),
                       (lambda: memory.page_kind(None), "numpy array or a torch tensor"),
                       (lambda: memory.page_policy("1 GiB"), "nbytes must be an int")):
        with pytest.raises(InvalidArgument, match=says):
            call()
    torch = pytest.importorskip("torch")
    for dtype in ("float16", np.float16):
        with pytest.raises(InvalidArgument, match="must be a torch dtype"):
            memory.empty_tensor((4,), dtype)
    assert memory.empty_tensor((4,), torch.float16).dtype == torch.float16
