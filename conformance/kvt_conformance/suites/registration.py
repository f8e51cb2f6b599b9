"""Registration: every declared memory kind, overlapping and zero-length
regions, deregister, double deregister."""

from __future__ import annotations

import numpy as np
import pytest
from kvt.errors import InvalidDescriptor, InvalidHandle
from kvt.types import Descs

from ..buffers import Buffer
from ..fixtures import BackendFixtures


class RegistrationTests(BackendFixtures):
    area = "registration"

    def test_register_and_deregister(self, backend, make_backend, kind):
        buf = make_backend.keep(Buffer(4096, kind))
        handle = backend.register(buf.region())
        backend.prep(None, buf.blocks(1024, [0, 3]))  # registered memory is preppable
        backend.deregister(handle)

    def test_registered_memory_is_the_only_preppable_memory(self, backend, make_backend, kind):
        buf = make_backend.keep(Buffer(4096, kind))
        with pytest.raises(InvalidDescriptor):
            backend.prep(None, buf.blocks(1024, [0]))
        handle = backend.register(buf.region())
        backend.prep(None, buf.blocks(1024, [0]))
        backend.deregister(handle)
        with pytest.raises(InvalidDescriptor):
            backend.prep(None, buf.blocks(1024, [0]))

    def test_several_regions_in_one_registration(self, backend, make_backend):
        bufs = [make_backend.keep(Buffer(2048)) for _ in range(3)]
        rows = Descs(np.concatenate([b.region().array for b in bufs]))
        handle = backend.register(rows)
        backend.prep(None, Descs.from_blocks([b.addr for b in bufs], 512, range(4)))
        backend.deregister(handle)

    def test_overlapping_regions(self, backend, make_backend):
        buf = make_backend.keep(Buffer(8192))
        whole = backend.register(buf.region())
        inner = backend.register(Descs.from_regions(buf.addr + 1024, 2048))
        straddle = backend.register(Descs.from_regions(buf.addr + 4096, 4096))
        # dropping one registration keeps memory another one still covers
        backend.deregister(whole)
        backend.prep(None, Descs.from_regions(buf.addr + 1024, 2048))
        backend.prep(None, Descs.from_regions(buf.addr + 6000, 100))
        with pytest.raises(InvalidDescriptor):
            backend.prep(None, Descs.from_regions(buf.addr, 512))
        backend.deregister(inner)
        backend.deregister(straddle)
        with pytest.raises(InvalidDescriptor):
            backend.prep(None, Descs.from_regions(buf.addr + 6000, 100))

    def test_same_region_twice(self, backend, make_backend):
        buf = make_backend.keep(Buffer(4096))
        a, b = backend.register(buf.region()), backend.register(buf.region())
        assert a != b, "each registration needs its own handle"
        backend.deregister(a)
        backend.prep(None, buf.blocks(1024, [1]))
        backend.deregister(b)

    def test_zero_length_region(self, backend, make_backend):
        buf = make_backend.keep(Buffer(64))
        handle = backend.register(Descs.from_regions(buf.addr, 0))
        backend.deregister(handle)
        empty = backend.register(Descs(np.zeros((0, 3), np.uint64)))
        backend.deregister(empty)

    def test_double_deregister(self, backend, make_backend):
        buf = make_backend.keep(Buffer(4096))
        keep = backend.register(buf.region())
        gone = backend.register(buf.region())
        backend.deregister(gone)
        with pytest.raises(InvalidHandle):
            backend.deregister(gone)
        # the failed call changed nothing
        backend.prep(None, buf.blocks(1024, [2]))
        backend.deregister(keep)

    def test_deregister_unknown_handle(self, backend):
        with pytest.raises(InvalidHandle):
            backend.deregister(987654321)
