"""The project's exception tree and the table of Kafka error codes.

Every failure kproxy raises is a ``KProxyError``; protocol failures carry the byte offset and the
field path where they happened. This module must not import anything that does I/O.

    KProxyError
    ├── ProtocolError
    │   ├── DecodeError            bytes that are not a valid Kafka message (offset, path)
    │   │   ├── FrameError         a size prefix that is negative or over the configured cap
    │   │   ├── UnsupportedVersionError   an api key or version the schema does not define
    │   │   └── RecordsError       a record batch that fails its CRC, size or codec checks
    │   └── EncodeError            a message that cannot be encoded (bad value for its type)
    └── ConfigError                invalid configuration or rules (file, line, reason)
"""

from __future__ import annotations


class KProxyError(Exception):
    """Base of every exception kproxy raises on purpose."""


class ProtocolError(KProxyError):
    """Something about Kafka wire bytes or messages is wrong."""


class DecodeError(ProtocolError):
    """Bytes that cannot be decoded. ``offset`` is where in the frame; ``path`` names the field."""

    def __init__(self, reason: str, offset: int | None = None, path: str | None = None) -> None:
        self.reason = reason
        self.offset = offset
        self.path = path
        where = []
        if path:
            where.append(path)
        if offset is not None:
            where.append(f"offset {offset}")
        super().__init__(f"{reason} ({', '.join(where)})" if where else reason)


class FrameError(DecodeError):
    """A frame's size prefix is negative or larger than the configured maximum."""


class UnsupportedVersionError(DecodeError):
    """The api key, or that version of it, is not in kproxy's schema."""


class RecordsError(DecodeError):
    """A record batch or legacy message set is corrupt, too large once decompressed, or unreadable."""


class EncodeError(ProtocolError):
    """A message holds a value that its field's type cannot carry in the requested version."""


class ConfigError(KProxyError):
    """Invalid configuration; ``file`` and ``line`` point at the offending text when known."""

    def __init__(self, reason: str, file: str | None = None, line: int | None = None) -> None:
        self.reason = reason
        self.file = file
        self.line = line
        loc = file or ""
        if file and line is not None:
            loc = f"{file}:{line}"
        super().__init__(f"{loc}: {reason}" if loc else reason)
