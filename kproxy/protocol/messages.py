"""The registry of Kafka APIs and the request/response envelopes built on it.

Maps (api key, version) to generated codecs, derives header versions from each API's flexible
versions, and turns whole frames (header + body, no size prefix) into ``Request`` and ``Response``
objects and back. Pure: no sockets, no clocks.
"""

from __future__ import annotations

import struct
from typing import Any

from kproxy.protocol import primitives as P
from kproxy.protocol.compiler import (
    Codec,
    encode_to,
    get_codec,
    message_class,
    settings_listeners,
    split_parts,
)
from kproxy.protocol.errors import DecodeError, TrailingBytesError, UnsupportedVersionError
from kproxy.protocol.schema import ApiSpec, MessageSpec, load_schema_files

_HH = struct.Struct(">hh").unpack_from
_HHI = struct.Struct(">hhi").unpack_from

_APIS: dict[int, ApiSpec] = {}
_BY_NAME: dict[str, ApiSpec] = {}
_MESSAGES: dict[str, MessageSpec] = {}


def _load() -> None:
    if _APIS:
        return
    for sf in load_schema_files():
        if sf.api is not None:
            if sf.api.key in _APIS:
                raise RuntimeError(f"api key {sf.api.key} declared in {sf.path} and {_APIS[sf.api.key].file}")
            _APIS[sf.api.key] = sf.api
            _BY_NAME[sf.api.name] = sf.api
        for m in sf.messages:
            _MESSAGES[m.name] = m


def apis() -> dict[int, ApiSpec]:
    _load()
    return _APIS


def api_by_name(name: str) -> ApiSpec:
    _load()
    return _BY_NAME[name]


def api_by_key(key: int) -> ApiSpec:
    _load()
    return _APIS[key]


def standalone_message(name: str) -> MessageSpec:
    _load()
    return _MESSAGES[name]


def supported_versions() -> dict[int, tuple[int, int]]:
    """{api_key: (min_version, max_version)} of every API kproxy can decode."""
    _load()
    out = {}
    for key, api in sorted(_APIS.items()):
        r, s = api.request, api.response
        assert r is not None and s is not None and r.versions.hi is not None and s.versions.hi is not None
        out[key] = (max(r.versions.lo, s.versions.lo), min(r.versions.hi, s.versions.hi))
    return out


def api_name(api_key: int) -> str:
    _load()
    api = _APIS.get(api_key)
    return api.name if api else f"api_{api_key}"


def request_header_version(api_key: int, api_version: int) -> int:
    # ControlledShutdown v0 predates client ids and uses header v0.
    if api_key == 7 and api_version == 0:
        return 0
    api = _APIS[api_key]
    assert api.request is not None
    return 2 if api_version in api.request.flexible else 1


def response_header_version(api_key: int, api_version: int) -> int:
    # ApiVersions responses always use header v0, even when flexible (KIP-511), so a client can
    # read the error code before it knows which versions the broker supports.
    if api_key == 18:
        return 0
    api = _APIS[api_key]
    assert api.response is not None
    return 1 if api_version in api.response.flexible else 0


def request_header_codec(version: int) -> Codec:
    return get_codec(standalone_message("RequestHeader"), version)


def response_header_codec(version: int) -> Codec:
    return get_codec(standalone_message("ResponseHeader"), version)


_REQ: dict[tuple[int, int], tuple[Codec, Codec]] = {}
_RESP: dict[tuple[int, int], tuple[Codec, Codec]] = {}
settings_listeners += [_REQ.clear, _RESP.clear]  # compiler.set_codec: other codecs from now on


def request_codecs(api_key: int, api_version: int) -> tuple[Codec, Codec]:
    """(header codec, body codec) for a request; UnsupportedVersionError if kproxy lacks it."""
    c = _REQ.get((api_key, api_version))
    if c is None:
        _load()
        api = _APIS.get(api_key)
        if api is None:
            raise UnsupportedVersionError(f"unknown api key {api_key}", 0, "request_header.request_api_key")
        assert api.request is not None
        if api_version not in api.request.versions:
            raise UnsupportedVersionError(
                f"{api.name} v{api_version} is not supported (kproxy decodes v{api.request.versions})",
                2, "request_header.request_api_version")
        c = (request_header_codec(request_header_version(api_key, api_version)),
             get_codec(api.request, api_version))
        _REQ[(api_key, api_version)] = c
    return c


def response_codecs(api_key: int, api_version: int) -> tuple[Codec, Codec]:
    c = _RESP.get((api_key, api_version))
    if c is None:
        _load()
        api = _APIS.get(api_key)
        if api is None:
            raise UnsupportedVersionError(f"unknown api key {api_key}")
        assert api.response is not None
        if api_version not in api.response.versions:
            raise UnsupportedVersionError(f"{api.name} v{api_version} response is not supported")
        c = (response_header_codec(response_header_version(api_key, api_version)),
             get_codec(api.response, api_version))
        _RESP[(api_key, api_version)] = c
    return c


def body_class(api_key: int, kind: str) -> type:
    """The one class that serves every version of an API's request or response body."""
    _load()
    return message_class(getattr(_APIS[api_key], kind))


class Request:
    """A decoded request: its header and body. ``api_key``, ``api_version``, ``correlation_id``
    and ``client_id`` read and write the header."""

    __slots__ = ("body", "header", "trailing")

    def __init__(self, header: Any, body: Any, trailing: Any = None) -> None:
        self.header = header
        self.body = body
        # Bytes after the body that a lenient peer sent (Kafka brokers ignore them); kept only when
        # decoded with keep_trailing, and re-emitted as they were.
        self.trailing = trailing

    @classmethod
    def build(cls, api_key: int, api_version: int, correlation_id: int, client_id: str | None,
              body: Any) -> Request:
        hc, _ = request_codecs(api_key, api_version)
        header = hc.cls(api_key, api_version, correlation_id, client_id)
        return cls(header, body)

    @property
    def api_key(self) -> int:
        return self.header.request_api_key

    @property
    def api_version(self) -> int:
        return self.header.request_api_version

    @property
    def correlation_id(self) -> int:
        return self.header.correlation_id

    @correlation_id.setter
    def correlation_id(self, value: int) -> None:
        self.header.correlation_id = value

    @property
    def client_id(self) -> str | None:
        return self.header.client_id

    @client_id.setter
    def client_id(self, value: str | None) -> None:
        self.header.client_id = value

    def __repr__(self) -> str:
        return (f"Request({api_name(self.api_key)} v{self.api_version}, "
                f"correlation_id={self.correlation_id}, client_id={self.client_id!r}, body={self.body!r})")


class Response:
    """A decoded response. The api key and version come from the request it answers."""

    __slots__ = ("api_key", "api_version", "body", "header", "trailing")

    def __init__(self, api_key: int, api_version: int, header: Any, body: Any,
                 trailing: Any = None) -> None:
        self.api_key = api_key
        self.api_version = api_version
        self.header = header
        self.body = body
        self.trailing = trailing

    @classmethod
    def build(cls, api_key: int, api_version: int, correlation_id: int, body: Any) -> Response:
        hc, _ = response_codecs(api_key, api_version)
        return cls(api_key, api_version, hc.cls(correlation_id), body)

    @property
    def correlation_id(self) -> int:
        return self.header.correlation_id

    @correlation_id.setter
    def correlation_id(self, value: int) -> None:
        self.header.correlation_id = value

    def __repr__(self) -> str:
        return (f"Response({api_name(self.api_key)} v{self.api_version}, "
                f"correlation_id={self.correlation_id}, body={self.body!r})")


def _view(frame: Any) -> memoryview:
    mv = frame if isinstance(frame, memoryview) else memoryview(frame)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def decode_request(frame: Any, keep_trailing: bool = False) -> Request:
    """Decode one request frame (header and body, without the 4-byte size prefix).

    Bytes after the body are a DecodeError, unless ``keep_trailing``: then they ride along in
    ``Request.trailing`` and are re-encoded unchanged. Brokers ignore such bytes, and some clients
    send them (librdkafka 2.16's Metadata v12 for all topics carries three), so a transparent proxy
    must let them through.
    """
    mv = _view(frame)
    end = len(mv)
    if end < 4:
        raise DecodeError(f"request of {end} bytes is shorter than api key and version", 0, "request_header")
    api_key, api_version = _HH(mv, 0)
    hc, bc = _REQ.get((api_key, api_version)) or request_codecs(api_key, api_version)
    header, pos = hc.decode_checked(mv, 0, end)
    body, pos = bc.decode_checked(mv, pos, end)
    if pos != end:
        if keep_trailing:
            return Request(header, body, mv[pos:end])
        raise TrailingBytesError(f"{end - pos} trailing bytes after the body", pos, bc.name)
    return Request(header, body)


def decode_response(frame: Any, api_key: int, api_version: int, keep_trailing: bool = False) -> Response:
    """Decode one response frame; the api key and version are those of the request it answers.

    ``keep_trailing`` as for ``decode_request``."""
    mv = _view(frame)
    end = len(mv)
    hc, bc = _RESP.get((api_key, api_version)) or response_codecs(api_key, api_version)
    header, pos = hc.decode_checked(mv, 0, end)
    body, pos = bc.decode_checked(mv, pos, end, 0)
    if pos != end:
        if keep_trailing:
            return Response(api_key, api_version, header, body, mv[pos:end])
        raise TrailingBytesError(f"{end - pos} trailing bytes after the body", pos, bc.name)
    return Response(api_key, api_version, header, body)


def _encode(hc: Codec, header: Any, bc: Codec, body: Any, framed: bool,
            trailing: Any = None) -> tuple[bytearray, list]:
    out = bytearray(4) if framed else bytearray()
    ins: list = []
    encode_to(hc, header, out, ins)
    encode_to(bc, body, out, ins)
    if trailing is not None:
        out += trailing
    if framed:
        size = len(out) - 4 + sum(len(b) for _, b in ins)
        P.INT32.pack_into(out, 0, size)
    return out, ins


def encode_request(req: Request) -> bytearray | list:
    """Encode a request (no size prefix): one bytearray, or a list of buffers when large bytes or
    records values are passed through without copying. Joined, it equals the decoded frame."""
    hc, bc = request_codecs(req.api_key, req.api_version)
    out, ins = _encode(hc, req.header, bc, req.body, False, req.trailing)
    return out if not ins else split_parts(out, ins)


def encode_response(resp: Response) -> bytearray | list:
    """Encode a response (no size prefix); same return convention as ``encode_request``."""
    hc, bc = response_codecs(resp.api_key, resp.api_version)
    out, ins = _encode(hc, resp.header, bc, resp.body, False, resp.trailing)
    return out if not ins else split_parts(out, ins)


def encode_request_frame(req: Request) -> list:
    """The request with its 4-byte size prefix, as a list of buffers for one vectored send."""
    hc, bc = request_codecs(req.api_key, req.api_version)
    return split_parts(*_encode(hc, req.header, bc, req.body, True, req.trailing))


def encode_response_frame(resp: Response) -> list:
    hc, bc = response_codecs(resp.api_key, resp.api_version)
    return split_parts(*_encode(hc, resp.header, bc, resp.body, True, resp.trailing))


def peek_request_header(frame: Any) -> tuple[int, int, int]:
    """(api_key, api_version, correlation_id) of a request frame without decoding the rest."""
    if len(frame) < 8:
        raise DecodeError(f"request of {len(frame)} bytes is shorter than its header", 0, "request_header")
    return _HHI(frame, 0)


