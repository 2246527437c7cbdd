"""kproxy's Kafka protocol core: schema-generated codecs for every API, framing and records.

Sans-I/O: this package turns bytes into messages and messages into bytes. It imports nothing that
touches sockets, clocks, trio, OpenTelemetry, YAML or Spark.
"""

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
