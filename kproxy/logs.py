"""The process's log output (readable text or one JSON object per line) and ``safe``, the one place
where strings a client chose are made fit for a log line.

A client id, SASL mechanism, topic name or software name is the client's to choose, so each goes
through ``safe`` before it reaches a log message: nobody can forge a log line or send escape codes to
an operator's terminal. This module does no I/O of its own beyond configuring ``logging``, so the
sans-I/O packages may use ``safe``.
"""

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Final, TextIO

TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS: Final = ("text", "json")

# The virtual cluster whose task logs a line, when the process runs several (the tasks of one
# virtual cluster inherit it from the task that opened its nursery): text lines name it after the
# logger, JSON lines as ``virtual_cluster``. None (the process's own lines, or one virtual cluster):
# nothing is added.
VIRTUAL_CLUSTER: ContextVar[str | None] = ContextVar("kproxy_virtual_cluster", default=None)

# The usual short escapes; a backslash is doubled so an escaped "\n" cannot be told apart from a
# client that sent a backslash and an "n".
_SHORT_ESCAPES: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
# surrogateescape maps an undecodable byte 0xNN to the lone surrogate U+DCNN.
_SURROGATE_BYTES: Final = range(0xDC80, 0xDD00)


def safe(value: str | bytes | None, limit: int = 200) -> str:
    """``value`` fit for one log line: control and non-printable characters escaped, length capped.

    Newlines become ``\\n``, other control characters ``\\x1b``, non-printable Unicode ``\\u200b``;
    bytes that are not UTF-8 show as ``\\xff``. Past ``limit`` characters the rest is cut and a marker
    says how many characters went. None (a Kafka null string) is ``null``.
    """
    if value is None:
        return "null"
    text = value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)
    cut = len(text) - max(limit, 0)
    if cut > 0:
        text = text[: max(limit, 0)]
    if not text.isprintable() or "\\" in text:
        text = "".join(c if c.isprintable() and c != "\\" else _escape(c) for c in text)
    return f"{text}[...{cut} more characters]" if cut > 0 else text


def _escape(c: str) -> str:
    short = _SHORT_ESCAPES.get(c)
    if short is not None:
        return short
    code = ord(c)
    if code in _SURROGATE_BYTES:
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, and ``exc``.

    json.dumps escapes every control and non-ASCII character, so no message can break a line. With
    ``process`` (one of several worker processes), each object also has ``process``.
    """

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace(
                "+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.process is not None:
            entry["process"] = self.process
        virtual_cluster = VIRTUAL_CLUSTER.get()
        if virtual_cluster is not None:
            entry["virtual_cluster"] = virtual_cluster
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, with the worker process and the virtual cluster after the logger's name when
    there are several: ``kproxy.server [worker 1] [team-a]: ...``."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__(TEXT_FORMAT.replace("%(name)s:", f"%(name)s [{process}]:") if process else TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        virtual_cluster = VIRTUAL_CLUSTER.get()
        if virtual_cluster is None:
            return text
        head, sep, message = text.partition(": ")
        return f"{head} [{virtual_cluster}]{sep}{message}"


class _Handler(logging.StreamHandler[TextIO]):
    """The handler configure_logging installs; a second call replaces it rather than adding one."""


def configure_logging(level: str, fmt: str, process: str | None = None) -> logging.Handler:
    """Send every log record at ``level`` or above to stderr as ``fmt`` ("text" or "json").

    ``process`` names this process among several (``worker 1``): text lines carry it after the
    logger's name, JSON objects as ``process``; the virtual cluster (``VIRTUAL_CLUSTER``) likewise. Returns the handler it installed on the root logger.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = _Handler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(TextFormatter(process))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    return handler
