"""What ``auth_key`` costs kvt's ZMQ channels (kvt.handshake), without and
with a key, in one run: a whole ``request()`` (connect, ZMQ's handshake, with
a key CURVE and kvt.auth's challenge, one message each way) and one message
round trip on an open connection (a DEALER to a ``RouterServer`` echoing a
small header and a payload of the given size; kvt.auth's tags cover the
header's bytes and the payload's length, as on the host data channel), at a
few sizes.  Medians.

    python benchmarks/bench_channel.py [--reps 300]

Runs on releases before ZMQ's CURVE too (a key then means kvt.auth alone),
so the same script gives both sides of an A/B.
"""

from __future__ import annotations

import argparse
import statistics
import time

import zmq

from kvt import handshake
from kvt.auth import ClientSession, Secret
from kvt.handshake import HandshakeServer, RouterServer, request

KEY = Secret("bench-" + "k" * 32)


def dealer(endpoint: str, secret: Secret | None) -> tuple[zmq.Socket, ClientSession | None]:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    if secret is not None and hasattr(handshake, "curve_client"):
        handshake.curve_client(s, secret)
    s.connect(endpoint)
    if secret is None:
        return s, None
    session = ClientSession(secret, covered=1)  # as the host data channel: the header's bytes, bulk lengths
    s.send(session.hello())
    session.accept(s.recv_multipart(), "bench")
    return s, session


def round_trips(endpoint: str, secret: Secret | None, size: int, reps: int) -> float:
    sock, session = dealer(endpoint, secret)
    body = [b"header", b"\0" * size]  # as a host request: a small header, then the bulk
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            sock.send_multipart(body + ([session.seal(body)] if session else []), copy=size < 65536)
            got = sock.recv_multipart(copy=size < 65536)
            if session:
                session.open(got, "bench")
            times.append(time.perf_counter() - t0)
    finally:
        sock.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    keys = {"no": None, "yes": KEY}
    print(f"{'what':<32} {'no key':>10} {'key':>10} {'key / no':>9}")
    for size in (64, 1 << 20):
        servers = {k: HandshakeServer(lambda body: body, secret=s).start() for k, s in keys.items()}
        try:
            med = {}
            for k, srv in servers.items():
                reps = max(20, args.reps // (1 + size // 65536))
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    assert len(request(srv.endpoint, b"\0" * size, 10, keys[k])) == size
                    ts.append(time.perf_counter() - t0)
                med[k] = statistics.median(ts)
        finally:
            for srv in servers.values():
                srv.close()
        print(f"{'request(), ' + str(size) + ' B':<32} {med['no'] * 1e6:>8.0f}us {med['yes'] * 1e6:>8.0f}us "
              f"{med['yes'] / med['no']:>8.2f}x")
    for size in (64, 65536, 4 << 20):
        servers = {k: RouterServer(lambda frames: frames[:2], secret=s, copy=False, covered=1).start() for k, s in keys.items()}
        try:
            reps = max(30, args.reps * 10 // (1 + size // 65536))
            med = {k: round_trips(srv.endpoint, keys[k], size, reps) for k, srv in servers.items()}
        finally:
            for srv in servers.values():
                srv.close()
        print(f"{'message round trip, ' + str(size) + ' B':<32} {med['no'] * 1e6:>8.0f}us {med['yes'] * 1e6:>8.0f}us "
              f"{med['yes'] / med['no']:>8.2f}x")


if __name__ == "__main__":
    main()
