"""kvt.epoch: the owner's deregistration counter as a same-host peer sees it."""

import os

from kvt import memory
from kvt.epoch import Epoch, EpochWatch
from kvt.types import Descs


def test_a_watch_turns_stale_when_the_owner_bumps():
    owner = Epoch()
    try:
        watch = EpochWatch.open(os.getpid(), owner.fd, owner.value)
        assert watch is not None and not watch.stale
        owner.bump()
        assert watch.stale
        assert not EpochWatch.open(os.getpid(), owner.fd, owner.value).stale  # fresh metadata: fresh watch
        watch.close()
    finally:
        owner.close()


def test_only_an_epoch_page_can_be_watched():
    seg = memory.empty((4096,))  # a kvt segment is a memfd too, but not an epoch
    fd = int(memory.segments_of(Descs.from_buffers([seg]))[0, 2])
    assert EpochWatch.open(os.getpid(), fd, 0) is None
    assert EpochWatch.open(os.getpid(), -1, 0) is None          # metadata without an epoch
    assert EpochWatch.open(os.getpid(), 10**6, 0) is None       # no such fd
