"""kvt: move KV-cache blocks (and any registered memory) between processes
through one backend protocol, the backend chosen by configuration."""

from importlib.metadata import PackageNotFoundError, version as _version

from .backend import Backend
from .errors import *  # noqa: F401,F403  (the error tree is public API)
from .errors import __all__ as _errors_all
from .types import (Availability, Capabilities, Descs, MemKind, Op, PrepHandle,
                    RegHandle, Status, XferHandle, XferState)

try:
    __version__ = _version("kvt")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"


def __getattr__(name):
    # Agent and config pull in zmq/torch glue; import them lazily so that
    # `import kvt` stays cheap for plugins that only need the SPI.
    if name in ("Agent", "Transfer"):
        from . import agent
        return getattr(agent, name)
    if name in ("Config", "load_config"):
        from . import config
        return getattr(config, name)
    raise AttributeError(f"module 'kvt' has no attribute {name!r}")


__all__ = ["Backend", "Availability", "Capabilities", "Descs", "MemKind", "Op",
           "PrepHandle", "RegHandle", "Status", "XferHandle", "XferState",
           "Agent", "Transfer", "Config", "load_config", "__version__", *_errors_all]
