"""How kvt's tools print log records.

The library only logs (``logging.getLogger(__name__)``) and configures
nothing: an engine's own logging setup decides.  The ``kvt`` command and
the child processes its tools start are programs of their own, and there a
record reads ``2026-11-27 23:50:01,123 WARNING kvt.agent[4242]: ...``: when,
how bad, which module, which process (the demo's and the bench's sides run
in children).  ``KVT_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, the
default, or ``ERROR``) sets what they print.
"""

from __future__ import annotations

import logging
import os

from .errors import ConfigError

__all__ = ["ENV_LOG_LEVEL", "FORMAT", "log_to_stderr"]

ENV_LOG_LEVEL = "KVT_LOG_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_to_stderr() -> None:
    """Print log records on stderr in ``FORMAT`` at ``KVT_LOG_LEVEL``, unless
    this process configured logging already (then that setup decides).
    ``ConfigError`` for a level that is not one of ``DEBUG INFO WARNING ERROR``."""
    raw = os.environ.get(ENV_LOG_LEVEL, "").strip().upper() or "WARNING"
    if raw not in _LEVELS:
        raise ConfigError(f"environment variable {ENV_LOG_LEVEL}={os.environ[ENV_LOG_LEVEL]!r} is not a log level; "
                          f"use one of {', '.join(_LEVELS)}")
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()  # on the root: plugins log as kvt_<name>, other libraries as themselves
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(raw)
