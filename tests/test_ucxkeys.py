"""kvt.ucxkeys: the envelope of UCX host-memory remote keys and worker addresses."""

from __future__ import annotations

import struct

import pytest

from kvt.ucxkeys import is_host_rkey, same_address_format

CMA = struct.pack("<Q", 1) + b"\x00" + b"\x00" + b"\xff"           # one md, an empty record, no sys device
TWO = struct.pack("<Q", 0b101) + b"\x00" + b"\x02ab" + b"\x00" + b"\x7f"  # two mds; high bit of the last byte off
TCP_ONLY = struct.pack("<Q", 0) + b"\x00"


@pytest.mark.parametrize("key", [CMA, TWO, TCP_ONLY])
def test_host_keys_as_ucp_rkey_pack_writes_them_pass(key):
    assert is_host_rkey(key)


@pytest.mark.parametrize("key", [
    b"", CMA[:8], CMA[:-1], CMA + b"\x00", TCP_ONLY + b"\xff",
    CMA[:8] + b"\x01" + CMA[9:],    # CUDA memory
    CMA[:8] + b"\x2e" + CMA[9:],    # past UCS_MEMORY_TYPE_LAST: segfaulted UCX's unpack
    CMA[:9] + b"\xc8" + CMA[10:],   # a record longer than the key
    struct.pack("<Q", 0b11) + CMA[8:],  # two mds promised, one record
    CMA[:-1] + b"\x03",             # a system device: distances would follow
])
def test_anything_else_fails(key):
    assert not is_host_rkey(key)


def test_address_format_is_the_low_nibble_of_the_first_byte():
    assert same_address_format(b"\x20rest", b"\x30ours")
    assert not same_address_format(b"\x28rest", b"\x20ours")
    assert not same_address_format(b"", b"\x20") and not same_address_format(b"\x20", b"")
