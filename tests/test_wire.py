"""Wire format: golden bytes (a format change must be deliberate) and
malformed input (a typed error, never a crash).

Regenerate the golden files only for an intended format change:
``python tests/test_wire.py --regenerate`` (and bump WIRE_VERSION if old
readers cannot decode the new bytes)."""

import sys
from pathlib import Path

import msgspec
import pytest

from kvt.errors import VersionMismatch, WireError
from kvt.wire import WIRE_VERSION, AgentInfo, BlockLayout, HandshakeReply, HandshakeRequest, decode, encode

GOLDEN = Path(__file__).parent / "golden"

SAMPLES = {
    "agent_info_v1.bin": AgentInfo(
        name="prefill-0", backend="host", metadata=b"\x00\x01opaque",
        layouts={"kv": BlockLayout(base_addrs=[0x7F0000000000, 0x7F0000100000], block_len=65536,
                                   num_blocks=16, stride=65536, device=0, kind="DRAM")},
        extra={"tp_size": 2, "dtype": "float16"}),
    "handshake_request_v1.bin": HandshakeRequest(sender="decode-3"),
    "handshake_reply_v1.bin": HandshakeReply(payload=b"abc", error=""),
}


@pytest.mark.parametrize("fname", sorted(SAMPLES))
def test_encoding_matches_golden_bytes(fname):
    assert encode(SAMPLES[fname]) == (GOLDEN / fname).read_bytes()


@pytest.mark.parametrize("fname", sorted(SAMPLES))
def test_golden_bytes_decode_to_sample(fname):
    msg = SAMPLES[fname]
    assert decode((GOLDEN / fname).read_bytes(), type(msg)) == msg


def test_unknown_appended_fields_are_ignored():
    # a newer peer may append defaulted fields; we must still read it
    raw = msgspec.msgpack.decode((GOLDEN / "handshake_request_v1.bin").read_bytes())
    raw["new_field"] = [1, 2, 3]
    assert decode(msgspec.msgpack.encode(raw), HandshakeRequest).sender == "decode-3"


def test_wrong_version_is_version_mismatch():
    raw = msgspec.msgpack.decode((GOLDEN / "agent_info_v1.bin").read_bytes())
    raw["v"] = WIRE_VERSION + 1
    with pytest.raises(VersionMismatch, match=f"version {WIRE_VERSION + 1}"):
        decode(msgspec.msgpack.encode(raw), AgentInfo)


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x93\x01\x02\x03", b"garbage bytes that are not msgpack",
    msgspec.msgpack.encode({"v": 1}),                                  # no tag
    msgspec.msgpack.encode({"v": 1, "t": "agent_info"}),               # missing fields
    msgspec.msgpack.encode({"v": 1, "t": "hs_req"}),                   # wrong message type
    msgspec.msgpack.encode({"v": 1, "t": "agent_info", "name": 5, "backend": "x", "metadata": b""}),
    msgspec.msgpack.encode({"v": "1", "t": "agent_info"}),
])
def test_malformed_bytes_are_wire_errors(data):
    with pytest.raises(WireError):
        decode(data, AgentInfo)


def test_non_bytes_is_wire_error():
    with pytest.raises(WireError, match="expected bytes"):
        decode("text", AgentInfo)


if __name__ == "__main__" and "--regenerate" in sys.argv:
    for fname, msg in SAMPLES.items():
        (GOLDEN / fname).write_bytes(encode(msg))
        print("wrote", GOLDEN / fname)
