"""kproxy's Kafka protocol core: schema-generated codecs for every API, framing and records.

Sans-I/O: this package turns bytes into messages and messages into bytes. It imports nothing that
touches sockets, clocks, trio, OpenTelemetry, YAML or Spark. The names below are imported when
first used, so a module that needs only ``kproxy.protocol.errors`` (the configuration does) does not
generate every codec.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kproxy.protocol.errors import (
        DecodeError,
        EncodeError,
        FrameError,
        ProtocolError,
        RecordsError,
        UnsupportedVersionError,
    )
    from kproxy.protocol.lazy import LazyArray
    from kproxy.protocol.messages import (
        Request,
        Response,
        decode_request,
        decode_response,
        encode_request,
        encode_request_frame,
        encode_response,
        encode_response_frame,
        peek_request_header,
        supported_versions,
    )

_HOMES = {
    "DecodeError": "errors", "EncodeError": "errors", "FrameError": "errors", "ProtocolError": "errors",
    "RecordsError": "errors", "UnsupportedVersionError": "errors",
    "LazyArray": "lazy",
    "Request": "messages", "Response": "messages", "decode_request": "messages",
    "decode_response": "messages", "encode_request": "messages", "encode_request_frame": "messages",
    "encode_response": "messages", "encode_response_frame": "messages",
    "peek_request_header": "messages", "supported_versions": "messages",
}

__all__ = [
    "DecodeError",
    "EncodeError",
    "FrameError",
    "LazyArray",
    "ProtocolError",
    "RecordsError",
    "Request",
    "Response",
    "UnsupportedVersionError",
    "decode_request",
    "decode_response",
    "encode_request",
    "encode_request_frame",
    "encode_response",
    "encode_response_frame",
    "peek_request_header",
    "supported_versions",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kproxy.protocol' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kproxy.protocol.{home}"), name)
