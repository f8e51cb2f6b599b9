"""Finding agents by name through a store operators already run.

An agent ``publish``-es its side-channel endpoint under a name with a lease;
peers ``resolve`` the name to the endpoint and handshake as usual (the
metadata itself still comes from the agent, so it is never stale).  A
publisher keeps its lease alive from a daemon thread; when it dies the lease
runs out and the name stops resolving.  Chosen by ``KVT_DISCOVERY`` (or the
``discovery`` setting):

* ``etcd://host:port[,host:port...]`` — etcd v3, through its JSON gateway
  (``/v3/kv/*``, ``/v3/lease/*``) over plain HTTP with the standard
  library: no client package, no protobuf pins.  Leases are etcd's own.
* ``tcpstore://host:port`` — torch's c10d ``TCPStore`` (zero install where
  torch is); ``tcpstore://host:port?server=1`` also hosts the store in this
  process.  TCPStore has no leases: a record carries its wall-clock expiry
  and the publisher rewrites it, so resolvers need clocks in step (NTP).

Everything a store answers is untrusted: sizes are bounded and a record must
name a ``tcp://`` endpoint.  Names are ``[A-Za-z0-9._-]``, at most 200 bytes.
"""

from __future__ import annotations

import atexit
import base64
import http.client
import json
import logging
import math
import re
import socket
import threading
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit
from weakref import WeakKeyDictionary

from .errors import ConfigError, DiscoveryError, InvalidArgument, UnknownPeer

__all__ = ["Store", "EtcdStore", "TcpStore", "open_store", "parse_url", "DEFAULT_TTL"]

log = logging.getLogger(__name__)

DEFAULT_TTL = 10.0       # seconds a dead publisher stays resolvable at most
_PREFIX = "/kvt/agents/"
_MAX_RECORD = 4096       # bytes of one record we accept from a store
_MAX_REPLY = 1 << 20     # bytes of one etcd gateway reply we read
MAX_TTL = 9_000_000_000  # seconds: etcd's own cap on a lease (MaxLeaseTTL)
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9._:\[\]-]{1,300}")
_HOST_PORT = re.compile(r"(?:[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}")


def parse_url(url: str | None) -> tuple[str, list[str], bool]:
    """``(scheme, ["host:port", ...], server)`` of a discovery URL;
    ``ConfigError`` for none, a malformed one or an unknown scheme (also
    checked when the configuration is loaded, so a typo shows at start)."""
    if not url:
        raise ConfigError("no discovery store configured: set KVT_DISCOVERY=etcd://host:port "
                          "(or tcpstore://host:port), or connect by tcp:// endpoint")
    try:
        parts = urlsplit(url)
        port = parts.port  # checked here: a port out of range or not a number raises ValueError
    except ValueError as e:
        raise ConfigError(f"discovery URL {url!r} is malformed ({e}); use etcd://host:port or "
                          "tcpstore://host:port") from None
    if parts.scheme == "etcd":
        members = [hp for hp in parts.netloc.split(",") if hp]
        for hp in members:
            if not _HOST_PORT.fullmatch(hp) or not 0 < int(hp.rpartition(":")[2]) < 65536:
                raise ConfigError(f"discovery URL {url!r}: {hp!r} is not host:port")
        return "etcd", members, False
    if parts.scheme == "tcpstore":
        if not parts.hostname or not port:
            raise ConfigError(f"discovery URL {url!r} needs tcpstore://host:port")
        return "tcpstore", [f"{parts.hostname}:{port}"], parse_qs(parts.query).get("server") == ["1"]
    raise ConfigError(f"discovery URL {url!r}: unknown scheme {parts.scheme!r}; use etcd:// or tcpstore://")


def open_store(url: str | None) -> "Store":
    """The store ``url`` names (``parse_url``)."""
    scheme, members, server = parse_url(url)
    if scheme == "etcd":
        return EtcdStore([f"http://{hp}" for hp in members])
    host, _, port = members[0].rpartition(":")
    return TcpStore(host, int(port), server=server)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(f"discovery name {name!r} must be 1-200 characters of A-Z a-z 0-9 . _ -")
    return name


def _endpoint_of(raw: bytes, name: str, where: str) -> tuple[str, float | None]:
    """(endpoint, expiry or None) from a stored record, checked."""
    try:
        if len(raw) > _MAX_RECORD:
            raise ValueError(f"{len(raw)} bytes")
        rec = json.loads(raw)
        endpoint, expires = rec["endpoint"], rec.get("expires")
        if not isinstance(endpoint, str) or not _ENDPOINT.fullmatch(endpoint):
            raise ValueError(f"endpoint {endpoint!r}")
        if expires is not None and (isinstance(expires, bool) or not isinstance(expires, (int, float))
                                    or not math.isfinite(expires)):
            raise ValueError(f"expiry {expires!r}")  # NaN or Infinity would never expire
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:  # deep nesting: RecursionError
        raise DiscoveryError(f"{where} holds an unreadable record for {name!r} ({e}); "
                             "is something else writing under /kvt/agents/?") from e
    return endpoint, expires


class Store:
    """What an agent needs from a discovery store.  Thread-safe."""

    def __init__(self):
        self._stop = threading.Event()
        self._published: dict[str, tuple[Any, str, float]] = {}  # name -> (the store's lease, endpoint, ttl)
        self._lock = threading.Lock()
        # held across each store call that writes a record (publish, withdraw, one renewal): a renewal
        # in flight must not write back a record that was withdrawn or re-published meanwhile
        self._writing = threading.Lock()
        self._keeper: threading.Thread | None = None

    def publish(self, name: str, endpoint: str, ttl: float | None = None) -> None:
        """Make ``name`` resolve to ``endpoint`` while this process lives (plus
        at most ``ttl`` seconds, default ``DEFAULT_TTL``)."""
        _check_name(name)
        if not isinstance(endpoint, str) or not _ENDPOINT.fullmatch(endpoint):
            raise InvalidArgument(f"discovery endpoint {endpoint!r} must be tcp://host:port")
        try:
            ttl = DEFAULT_TTL if ttl is None else float(ttl)
        except (TypeError, ValueError, OverflowError):
            raise InvalidArgument(f"discovery ttl must be a number of seconds, got {ttl!r}") from None
        if not 1 <= ttl <= MAX_TTL:  # NaN and Infinity too
            raise InvalidArgument(f"discovery ttl must be >= 1 second and <= {MAX_TTL}, got {ttl}")
        with self._writing, self._lock:
            self._published[name] = (self._put(name, endpoint, ttl), endpoint, ttl)
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep, name="kvt-discovery", daemon=True)
                self._keeper.start()

    def resolve(self, name: str, timeout: float = 5.0) -> str:
        """The endpoint published under ``name``.  ``UnknownPeer`` if none
        (never published, withdrawn, or its lease ran out); ``DiscoveryError``
        if the store cannot be asked."""
        _check_name(name)
        endpoint = self._get(name, timeout)
        if endpoint is None:
            raise UnknownPeer(f"no agent is published as {name!r} in {self} (never started, stopped, "
                              "or its lease expired)")
        return endpoint

    def withdraw(self, name: str) -> None:
        """Stop publishing ``name`` (it stops resolving now; a renewal in
        flight is waited for, so it cannot publish the name again)."""
        with self._writing:
            with self._lock:
                rec = self._published.pop(name, None)
            if rec is not None:
                self._drop(name, rec[0])

    def close(self) -> None:
        """Withdraw everything this store published; idempotent."""
        self._stop.set()
        for name in list(self._published):
            try:
                self.withdraw(name)
            except DiscoveryError as e:  # the lease then runs out by itself
                log.warning("could not withdraw %r: %s", name, e)

    def _keep(self) -> None:
        """Renew every lease three times per ttl (the shortest one)."""
        while True:
            with self._lock:
                items = list(self._published.items())
            if self._stop.wait(max(0.3, min((ttl for _, (_, _, ttl) in items), default=DEFAULT_TTL) / 3)):
                return
            for name, _ in items:
                with self._writing:
                    if self._stop.is_set():
                        return
                    with self._lock:
                        rec = self._published.get(name)  # as it is now: withdrawn or re-published meanwhile?
                    if rec is None:
                        continue
                    lease, endpoint, ttl = rec
                    try:
                        fresh = self._renew(name, lease, endpoint, ttl)
                    except DiscoveryError as e:  # keep trying: the store may come back within the ttl
                        log.warning("renewing %r in %s failed: %s", name, self, e)
                        continue
                    except Exception as e:  # noqa: BLE001 - a store's answer must not end the renewals
                        log.warning("renewing %r in %s failed: %r", name, self, e)
                        continue
                    with self._lock:
                        self._published[name] = (fresh, endpoint, ttl)

    # -- what each store implements ---------------------------------------------------
    def _put(self, name: str, endpoint: str, ttl: float) -> Any:
        """Store the record under a lease of ``ttl`` seconds; returns the lease."""
        raise NotImplementedError

    def _get(self, name: str, timeout: float) -> str | None:
        raise NotImplementedError

    def _renew(self, name: str, lease: Any, endpoint: str, ttl: float) -> Any:
        """Keep the lease alive (or store the record anew); returns the lease now in use."""
        raise NotImplementedError

    def _drop(self, name: str, lease: Any) -> None:
        raise NotImplementedError


class _ReplyTooBig(Exception):
    pass


def _post(url: str, path: str, data: bytes, timeout: float) -> tuple[int, bytes]:
    """(status, body) of one HTTP POST, everything within ``timeout`` seconds:
    plain ``http.client`` (no proxy from the environment, no redirects), and a
    timer that shuts the socket down at the deadline, since a socket timeout
    bounds each read, not the reply."""
    hostport = url.split("://", 1)[1]
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection(hostport, timeout=timeout)
    cut = threading.Event()

    def _cut() -> None:
        cut.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, _cut)
    timer.daemon = True
    try:
        conn.connect()  # bounded by the socket timeout
        timer.interval = max(0.0, deadline - time.monotonic())
        timer.start()
        if cut.is_set():
            raise TimeoutError("no reply within the timeout")
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = b""
        while len(raw) <= _MAX_REPLY:
            chunk = r.read1(_MAX_REPLY + 1 - len(raw)) if hasattr(r, "read1") else r.read(65536)
            if not chunk:
                break
            raw += chunk
        if cut.is_set():
            raise TimeoutError(f"no whole reply within {timeout} s")
        if len(raw) > _MAX_REPLY:
            raise _ReplyTooBig()
        return r.status, raw
    finally:
        timer.cancel()
        conn.close()


class EtcdStore(Store):
    """etcd v3 through its JSON gateway; one lease per published name."""

    def __init__(self, urls: list[str], timeout: float = 5.0):
        super().__init__()
        if not urls:
            raise ConfigError("etcd discovery needs at least one host:port")
        self.urls, self.timeout = urls, timeout

    def __str__(self) -> str:
        return f"etcd at {','.join(self.urls)}"

    def _call(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST ``body`` to ``path`` on the first member that answers; each
        member gets ``timeout`` in all (connect, headers and body: a member
        that trickles its reply is cut at the deadline)."""
        data = json.dumps(body).encode()
        limit = timeout if timeout and 0 < timeout <= MAX_TTL else self.timeout
        last: Exception | None = None
        for url in self.urls:  # any member of the cluster answers
            try:
                status, raw = _post(url, path, data, limit)
                if status != 200:
                    raise DiscoveryError(f"{self} refused {path}: HTTP {status} {raw[:500]!r}")
                out = json.loads(raw)
                if not isinstance(out, dict):
                    raise ValueError("not an object")
                return out
            except _ReplyTooBig:
                raise DiscoveryError(f"{self} sent a reply over {_MAX_REPLY} bytes to {path}") from None
            except (OSError, ValueError, RecursionError, http.client.HTTPException) as e:
                # unreachable, timed out, cut at the deadline, not HTTP, not JSON: try the next member
                last = e
        raise DiscoveryError(f"{self} is unreachable ({path}: {last!r}); is etcd running there?") from last

    @staticmethod
    def _key(name: str) -> str:
        return base64.b64encode((_PREFIX + name).encode()).decode()

    def _put(self, name: str, endpoint: str, ttl: float) -> str:
        lease = self._call("/v3/lease/grant", {"TTL": max(1, int(round(ttl)))}).get("ID")
        if not isinstance(lease, str) or not lease.isdigit():
            raise DiscoveryError(f"{self} granted no lease (got {lease!r})")
        value = base64.b64encode(json.dumps({"endpoint": endpoint}).encode()).decode()
        self._call("/v3/kv/put", {"key": self._key(name), "value": value, "lease": lease})
        return lease

    def _get(self, name: str, timeout: float) -> str | None:
        kvs = self._call("/v3/kv/range", {"key": self._key(name)}, timeout).get("kvs") or []
        try:
            raw = base64.b64decode(kvs[0]["value"], validate=True) if kvs else None
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise DiscoveryError(f"{self} sent an unreadable range reply for {name!r}: {e}") from e
        return None if raw is None else _endpoint_of(raw, name, str(self))[0]

    def _renew(self, name: str, lease: str, endpoint: str, ttl: float) -> str:
        result = self._call("/v3/lease/keepalive", {"ID": lease}).get("result")
        try:
            alive = int(result.get("TTL", 0)) > 0
        except (AttributeError, TypeError, ValueError, OverflowError):  # e.g. "TTL": Infinity
            alive = False
        # a lease that ran out meanwhile (etcd unreachable for a whole ttl): publish anew
        return lease if alive else self._put(name, endpoint, ttl)

    def _drop(self, name: str, lease: str) -> None:
        self._call("/v3/lease/revoke", {"ID": lease})


# c10d connects its caller gave up on -> how long exit waits for them.  A c10d
# call that returns while the interpreter finalises kills the process (its
# thread unwinds through C++ frames: "terminate called without an active
# exception", SIGABRT), so exit waits for these until c10d gives up.  c10d
# tries twice with a random pause between (2-3 timeouts measured idle, 4 on
# a loaded machine); the margin is for a loaded machine, and costs nothing
# once the thread ends.
_ABANDONED_CONNECTS: "WeakKeyDictionary[threading.Thread, float]" = WeakKeyDictionary()
_EXIT_MARGIN = 10.0  # seconds


@atexit.register
def _await_abandoned_connects() -> None:
    for t, deadline in list(_ABANDONED_CONNECTS.items()):
        t.join(max(0.0, deadline - time.monotonic()))


class TcpStore(Store):
    """torch's c10d TCPStore; records carry their expiry (it has no leases).

    c10d's client calls block without a deadline once connected (a store
    host that stops answering held ``Agent.connect`` for good), so each runs
    on a thread of its own that the caller waits for within its timeout;
    while one call has not come back, further calls fail at once (at most
    one thread is ever left waiting on a silent store).  Exit waits for an
    abandoned connect until c10d gives up on it (up to four timeouts and
    10 s), never for an abandoned call on a silent store."""

    def __init__(self, host: str, port: int, server: bool = False, timeout: float = 5.0):
        super().__init__()
        import datetime

        try:
            from torch.distributed import TCPStore as _TCPStore
        except ImportError as e:
            raise ConfigError("tcpstore:// discovery needs torch (pip install torch)") from e
        self.where, self.timeout = f"TCPStore at {host}:{port}", timeout
        self._stuck: tuple[threading.Thread, str] | None = None  # a call that has not come back
        self._calls = threading.Lock()  # guards _stuck (not Store._lock: publish holds that across _put)
        self._s = self._call("connecting", timeout, _TCPStore, host, port, is_master=server,
                             wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout))

    def __str__(self) -> str:
        return self.where

    def _call(self, what: str, limit: float, fn, *args, **kw) -> Any:
        """``fn(*args, **kw)`` within ``limit`` seconds; ``DiscoveryError`` otherwise."""
        with self._calls:
            if self._stuck is not None and self._stuck[0].is_alive():
                raise DiscoveryError(f"{self.where} has not answered an earlier call ({self._stuck[1]}); "
                                     "is the store host up and not overloaded?")
            self._stuck = None
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = fn(*args, **kw)
            except Exception as e:  # noqa: BLE001 - c10d's RuntimeError / DistStoreError, reported below
                out["error"] = e

        t = threading.Thread(target=run, name="kvt-tcpstore", daemon=True)
        started = time.monotonic()
        t.start()
        t.join(limit)
        if t.is_alive():
            with self._calls:
                self._stuck = (t, what)
            if what == "connecting":
                _ABANDONED_CONNECTS[t] = started + 4 * self.timeout + _EXIT_MARGIN
            raise DiscoveryError(f"{self.where} did not answer ({what}) within {limit:g}s; is it a TCPStore, "
                                 "and is its host up?")
        if "error" in out:
            raise DiscoveryError(f"{self.where}: {what} failed: {out['error']}") from out["error"]
        return out["value"]

    def _write(self, name: str, endpoint: str, ttl: float) -> None:
        rec = json.dumps({"endpoint": endpoint, "expires": time.time() + ttl})
        self._call(f"publishing {name!r}", self.timeout, self._s.set, _PREFIX + name, rec)

    def _put(self, name: str, endpoint: str, ttl: float) -> None:
        self._write(name, endpoint, ttl)

    def _get(self, name: str, timeout: float) -> str | None:
        key = _PREFIX + name

        def get() -> bytes | None:
            return self._s.get(key) if self._s.check([key]) else None

        raw = self._call(f"resolving {name!r}", timeout if 0 < timeout <= MAX_TTL else self.timeout, get)
        if raw is None:
            return None
        endpoint, expires = _endpoint_of(raw, name, self.where)
        return None if expires is None or expires < time.time() else endpoint

    def _renew(self, name: str, lease: None, endpoint: str, ttl: float) -> None:
        self._write(name, endpoint, ttl)

    def _drop(self, name: str, lease: Any) -> None:
        self._call(f"withdrawing {name!r}", self.timeout, self._s.delete_key, _PREFIX + name)

    def close(self) -> None:
        super().close()
        del self._s  # the c10d client (or server) goes with its last reference
