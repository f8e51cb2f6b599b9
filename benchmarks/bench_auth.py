"""Cost of kvt.auth per message: seal a request, check it at the server, seal
the reply, check it at the client (what one authenticated host-backend
request adds), for request headers of 1 and 1,024 rows and a WRITE carrying
16 MiB of payload (only its length is MAC'd).  Run under bench-quiet."""

import time

import numpy as np
from kvt.auth import ClientSession, Secret, ServerAuth
from kvt.wire import encode
from kvt_host.protocol import Reply, Request


def main(n: int = 20000) -> None:
    secret = Secret("bench-key-0123456789abcdef")
    server = ServerAuth(secret, covered=1)
    client = ClientSession(secret, covered=1)
    client.accept(server.serve([client.hello()], None, None), "bench")
    reply = [encode(Reply(id=1))]
    for label, rows, payload in (("READ, 1 row", 1, None), ("READ, 1,024 rows", 1024, None),
                                 ("WRITE, 1,024 rows + 16 MiB payload", 1024, np.zeros(16 << 20, np.uint8))):
        header = encode(Request(id=1, sender="bench", op="READ", rows=np.zeros((rows, 3), np.uint64).tobytes()))
        frames = [header] + ([payload] if payload is not None else [])
        t0 = time.perf_counter()
        for _ in range(n):
            msg = frames + [client.seal(frames)]
            out = server.serve(msg, lambda f: reply, None)
            client.open(out, "bench")
        us = (time.perf_counter() - t0) / n * 1e6
        print(f"{label:40s} {us:7.1f} us per request+reply ({len(header)} header bytes)")


if __name__ == "__main__":
    main()
