"""Test hosts: network namespaces joined by a bridge, each running its own processes.

``Network(n)`` creates ``n`` namespaces ("hosts"), each with one veth leg
into a bridge that lives in one more namespace (the "switch"), and an
address in a /24 of its own: nothing touches the root namespace, so traffic
stays inside the test network and parallel runs cannot collide (names carry
the pid and a random tag; the subnet is drawn from 10.64.0.0/10 and skipped
if any namespace of this machine already uses it).

``Host.popen(argv)`` runs a process in a host (``ip netns exec``);
``Host.netem(delay_ms=..., loss_pct=..., rate=...)`` shapes its egress with
``tc netem``.  ``unavailable()`` says why namespaces cannot be made here
(``None`` when they can).  Every command has a timeout; ``close()`` removes
everything, and so does a finaliser if a test forgets.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
import weakref
from typing import Sequence

__all__ = ["Network", "Host", "NetemUnavailable", "unavailable"]


class NetemUnavailable(RuntimeError):
    """The kernel cannot shape traffic the way a test asked."""


def _check(argv: list[str], what: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT)
    if r.returncode:
        raise NetemUnavailable(f"{what} failed: {r.stderr.strip()}")

_TIMEOUT = 20.0


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT, check=check)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or ``None``."""
    if not shutil.which("ip") or not shutil.which("tc") or not shutil.which("iptables"):
        return "needs iproute2 (`ip`, `tc`) and iptables (scripts/dev setup installs them as root)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the suite as root)"
    probe = f"kvtprobe{os.getpid()}{secrets.token_hex(2)}"
    try:
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed: {e}"
    if r.returncode:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_TIMEOUT)
    return None


def _used_subnets() -> set[str]:
    """/24 prefixes ("10.a.b") configured in any namespace of this machine."""
    used = set()
    names = [None] + [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    for ns in names:
        r = _ip("-4", "-o", "addr", "show", ns=ns, check=False)
        for line in r.stdout.splitlines():
            parts = line.split()
            if "inet" in parts:
                used.add(parts[parts.index("inet") + 1].rsplit(".", 1)[0])
    return used


class Host:
    """One namespace: its name, address and interface."""

    def __init__(self, ns: str, addr: str, dev: str):
        self.ns, self.addr, self.dev = ns, addr, dev

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: Sequence[str], timeout: float = _TIMEOUT, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), timeout=timeout, **kwargs)

    def netem(self, delay_ms: float = 0, loss_pct: float = 0, rate: str | None = None) -> None:
        """Shape this host's outgoing traffic (replaces earlier shaping; all zero clears it).

        ``tc netem`` where the kernel has it.  Kernels built without netem
        (e.g. some VM kernels) still get loss from iptables' ``statistic``
        match and a rate limit from ``tbf``; a delay then raises
        ``NetemUnavailable``."""
        subprocess.run(self.argv(["tc", "qdisc", "del", "dev", self.dev, "root"]), capture_output=True,
                       timeout=_TIMEOUT)
        subprocess.run(self.argv(["iptables", "-F", "OUTPUT"]), capture_output=True, timeout=_TIMEOUT)
        if not (delay_ms or loss_pct or rate):
            return
        spec = (["delay", f"{delay_ms}ms"] if delay_ms else []) + (["loss", f"{loss_pct}%"] if loss_pct else []) \
            + (["rate", rate] if rate else [])
        r = subprocess.run(self.argv(["tc", "qdisc", "replace", "dev", self.dev, "root", "netem", *spec]),
                           capture_output=True, text=True, timeout=_TIMEOUT)
        if r.returncode == 0:
            return
        if delay_ms:
            raise NetemUnavailable(f"tc netem is not available here ({r.stderr.strip()}); cannot add delay")
        if loss_pct:
            _check(self.argv(["iptables", "-A", "OUTPUT", "-o", self.dev, "-m", "statistic", "--mode", "random",
                              "--probability", f"{loss_pct / 100:.6f}", "-j", "DROP"]), "iptables statistic")
        if rate:
            _check(self.argv(["tc", "qdisc", "replace", "dev", self.dev, "root", "tbf", "rate", rate,
                              "burst", "64kb", "latency", "100ms"]), "tc tbf")

    def __repr__(self) -> str:
        return f"Host({self.ns}, {self.addr})"


class Network:
    """``n`` hosts on one bridged /24.  A context manager; ``close()`` is idempotent."""

    def __init__(self, n: int = 2):
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.switch = f"kvt{tag}sw"
        self.hosts: list[Host] = []
        self._names = [self.switch]
        self._finalizer = weakref.finalize(self, _delete, self._names)
        used = _used_subnets()
        rnd = random.Random(secrets.randbits(32))
        while True:
            prefix = f"10.{rnd.randint(64, 127)}.{rnd.randint(0, 255)}"
            if prefix not in used:
                break
        try:
            subprocess.run(["ip", "netns", "add", self.switch], check=True, capture_output=True, timeout=_TIMEOUT)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for i in range(n):
                ns = f"kvt{tag}h{i}"
                subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=_TIMEOUT)
                self._names.append(ns)
                # create the pair inside the host namespace, then move the far leg to the switch
                _ip("link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", ns=ns)
                _ip("link", "set", f"p{i}", "netns", self.switch, ns=ns)
                _ip("link", "set", f"p{i}", "master", "br0", ns=self.switch)
                _ip("link", "set", f"p{i}", "up", ns=self.switch)
                addr = f"{prefix}.{i + 1}"
                _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
                self.hosts.append(Host(ns, addr, "eth0"))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _delete(names: list[str]) -> None:
    for ns in reversed(names):
        # processes left in a namespace keep it alive after `ip netns del`; end them first
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=_TIMEOUT)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), 9)
            except (OSError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_TIMEOUT)
