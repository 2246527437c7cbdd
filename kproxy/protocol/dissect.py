"""A protocol dissector for people: one Kafka frame, pasted as hex or given as raw bytes, becomes JSON.

It reads the dumps people actually have (spaced or colon-separated hex, ``0x`` prefixes, offset
columns), decodes with the proxy's own generated codecs, opens record batches, and never prints a
SASL token or other secret. Pure: the command line reads the input and prints the result.
"""

from __future__ import annotations

import base64
import re
import struct
from typing import Any

from kproxy.protocol.compiler import codec_implementation, compiled_text, get_codec
from kproxy.protocol.errors import DecodeError, RecordsError, TrailingBytesError, UnsupportedVersionError
from kproxy.protocol.framing import foreign_protocol
from kproxy.protocol.messages import (
    api_name,
    apis,
    decode_request,
    decode_response,
    request_codecs,
    response_codecs,
)
from kproxy.protocol.records import Compression, LegacyMessage, Record, RecordBatch, iter_batches
from kproxy.protocol.schema import ApiSpec, FieldSpec, StructSpec

__all__ = ["codec_text", "dissect", "parse_hex", "resolve_api"]

_SIZE = struct.Struct(">i")

# Bytes fields that carry credentials, in any API: SASL tokens (PLAIN sends the password in clear),
# delegation-token HMACs (the token's password) and SCRAM salted passwords.
SECRET_FIELDS = frozenset({"auth_bytes", "hmac", "salted_password"})

# --------------------------------------------------------------------------------------------------
# Hex input

_COMMENT = re.compile(r"#.*|//.*")
_ASCII_COLUMN = re.compile(r"\|.*\|\s*$")  # hexdump -C prints the bytes as text between bars
_TOKEN = re.compile(r"\S+")
_HEX = re.compile(r"[0-9a-fA-F]*")
_OFFSET = re.compile(r"(?:0[xX])?([0-9a-fA-F]{4,}):?")


def _hex_digits(token: str) -> str | None:
    """The hex digits of one token, or None when it is not hex."""
    t = token.strip(",;")
    if t[:2] in ("0x", "0X"):
        t = t[2:]
        if len(t) == 1:  # C arrays write 0x0 for a zero byte
            t = "0" + t
    t = t.replace(":", "")  # colon-separated bytes: 00:00:00:4e
    return t if _HEX.fullmatch(t) else None


def _offset_column(lines: list[tuple[int, list[tuple[int, str]]]]) -> str | None:
    """The hex digits of a dump whose every line starts with its byte offset (xxd, hexdump -C, the
    protocol guide's ``0000:`` dumps), or None when the first column is not an offset column."""
    offsets = []
    for _, tokens in lines:
        m = _OFFSET.fullmatch(tokens[0][1])
        if m is None:
            return None
        offsets.append(int(m.group(1), 16))
    colons = all(tokens[0][1].endswith(":") for _, tokens in lines)
    # Without colons a first column of hex is only an offset column if it counts the bytes exactly.
    if not colons and (len(lines) < 2 or offsets[0] != 0):
        return None
    out: list[str] = []
    data_end = None  # text column where the previous line's data ended; an ASCII column starts later
    for i, (_, tokens) in enumerate(lines):
        want = 2 * (offsets[i + 1] - offsets[i]) if i + 1 < len(lines) else None
        if want is not None and want <= 0:
            return _first_hex_tokens(lines) if colons else None
        # The last line has no next offset to count its bytes; xxd pads it, so its ASCII column
        # starts no earlier than the previous line's data ended.
        limit = data_end if want is None else None
        got = 0
        for col, tok in tokens[1:]:
            if got == want or (limit is not None and col >= limit):
                break
            digits = _hex_digits(tok)
            if digits is None:
                break
            out.append(digits)
            got += len(digits)
            data_end = col + len(tok)
        if want is not None and got != want:
            return _first_hex_tokens(lines) if colons else None
    return "".join(out)


def _first_hex_tokens(lines: list[tuple[int, list[tuple[int, str]]]]) -> str:
    """Offsets that do not count the bytes: drop them and read each line up to its first non-hex token."""
    out = []
    for _, tokens in lines:
        for _, tok in tokens[1:]:
            digits = _hex_digits(tok)
            if digits is None:
                break
            out.append(digits)
    return "".join(out)


def parse_hex(text: str) -> bytes:
    """Bytes from hex text: whitespace, newlines, ``0x`` prefixes, commas and colons between bytes,
    ``#`` comments, and a leading offset column (``0000:``, xxd, hexdump -C) are all accepted."""
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        line = _ASCII_COLUMN.sub("", _COMMENT.sub("", line))
        tokens = [(m.start(), m.group()) for m in _TOKEN.finditer(line)]
        if tokens:
            lines.append((number, tokens))
    digits = _offset_column(lines) if lines else ""
    if digits is None:
        parts = []
        for number, tokens in lines:
            for _, tok in tokens:
                d = _hex_digits(tok)
                if d is None:
                    raise DecodeError(f"{tok[:20]!r} is not hex", None, f"input line {number}")
                parts.append(d)
        digits = "".join(parts)
    if len(digits) % 2:
        raise DecodeError(f"odd number of hex digits ({len(digits)})", None, "input")
    return bytes.fromhex(digits)


# --------------------------------------------------------------------------------------------------
# Rendering


def _printable(text: str) -> bool:
    return all(c.isprintable() or c in "\t\n\r" for c in text)


def render_bytes(value: Any) -> Any:
    """UTF-8 text when the bytes are printable text, else ``{"base64": ...}``; None stays None."""
    if value is None:
        return None
    data = bytes(value)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:
        if _printable(text):
            return text
    return {"base64": base64.b64encode(data).decode("ascii")}


def _render_text(value: str | None) -> Any:
    # Decoders keep invalid UTF-8 as surrogate escapes; JSON output gets the bytes instead.
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return {"base64": base64.b64encode(value.encode("utf-8", "surrogateescape")).decode("ascii")}
    return value


def _render_record(r: Record) -> dict[str, Any]:
    return {
        "offset": r.offset,
        "timestamp": r.timestamp,
        "key": render_bytes(r.key),
        "value": render_bytes(r.value),
        "headers": [{"key": _render_text(h.key), "value": render_bytes(h.value)} for h in r.headers],
    }


def _render_legacy(m: LegacyMessage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "offset": m.offset,
        "magic": m.magic,
        "crc": f"0x{m.crc:08x}",
        "crc_valid": m.verify_crc(),
        "attributes": m.attributes,
        "compression": m.compression.name.lower(),
    }
    if m.magic == 1:
        out["timestamp"] = m.timestamp
        out["timestamp_type"] = m.timestamp_type.name.lower()
    out["key"] = render_bytes(m.key)
    if m.compression is Compression.NONE:
        out["value"] = render_bytes(m.value)
    else:
        out["messages"] = [_render_legacy(inner) for inner in m.records()]
    return out


def _render_batch(b: RecordBatch | LegacyMessage) -> dict[str, Any]:
    if isinstance(b, LegacyMessage):
        return _render_legacy(b)
    return {
        "base_offset": b.base_offset,
        "batch_length": b.batch_length,
        "partition_leader_epoch": b.partition_leader_epoch,
        "magic": b.magic,
        "crc": f"0x{b.crc:08x}",
        "crc_valid": b.verify_crc(),
        "attributes": b.attributes,
        "compression": b.compression.name.lower(),
        "timestamp_type": b.timestamp_type.name.lower(),
        "is_transactional": b.is_transactional,
        "is_control": b.is_control,
        "last_offset_delta": b.last_offset_delta,
        "base_timestamp": b.base_timestamp,
        "max_timestamp": b.max_timestamp,
        "producer_id": b.producer_id,
        "producer_epoch": b.producer_epoch,
        "base_sequence": b.base_sequence,
        "record_count": b.record_count,
        "records": [_render_record(r) for r in b.records()],
    }


class _Renderer:
    """One pass over a body's ``to_dict`` output, guided by its schema, turning wire values into JSON."""

    def __init__(self, frame: bytes, response: bool) -> None:
        self.frame = frame
        self.cursor = 0  # records fields are visited in wire order; each is found after the last
        # Brokers cut the last batch of a Fetch response at max_bytes; a request is never cut.
        self.allow_truncated = response

    def struct(self, d: dict[str, Any], spec: StructSpec, version: int, path: str) -> dict[str, Any]:
        for f in spec.fields:
            value = d.get(f.name)
            if value is None:
                continue
            where = f"{path}.{f.name}"
            if f.array:
                d[f.name] = [self.value(f, e, version, f"{where}[{i}]") for i, e in enumerate(value)]
            else:
                d[f.name] = self.value(f, value, version, where)
        unknown = d.get("_unknown_tagged_fields")
        if unknown:
            d["_unknown_tagged_fields"] = [{"tag": u["tag"], "hex": u["data"].hex()} for u in unknown]
        return d

    def value(self, f: FieldSpec, value: Any, version: int, path: str) -> Any:
        if f.type == "struct":
            assert f.struct is not None
            return self.struct(value, f.struct, version, path)
        if f.type == "bytes":
            if f.name in SECRET_FIELDS:
                return f"<redacted {len(value)} bytes>"
            return render_bytes(value)
        if f.type == "records":
            return self.records(value, path)
        if f.type == "string":
            return _render_text(value)
        if f.type == "uuid":
            return str(value)
        return value

    def records(self, data: bytes, path: str) -> dict[str, Any]:
        # Only to turn offsets inside the field into frame offsets for errors. A records field of a
        # few bytes could match an identical run before it; its error offset is then approximate.
        at = self.frame.find(data, self.cursor)
        if at >= 0:
            self.cursor = at + len(data)
        batches = iter_batches(data, allow_truncated=self.allow_truncated)
        out: list[dict[str, Any]] = []
        try:
            out.extend(_render_batch(b) for b in batches)
        except RecordsError as e:
            offset = at + e.offset if at >= 0 and e.offset is not None else None
            raise DecodeError(e.reason, offset, path) from None
        result: dict[str, Any] = {"bytes": len(data), "batches": out}
        if batches.truncated:
            assert batches.truncated_at is not None
            result["truncated_bytes"] = len(data) - batches.truncated_at
        return result


def _dissect_frame(frame: bytes, response: bool, api_key: int | None, api_version: int | None
                   ) -> dict[str, Any]:
    if response:
        assert api_key is not None and api_version is not None
        resp = decode_response(frame, api_key, api_version)
        header, body = resp.header, resp.body
        hc, bc = response_codecs(api_key, api_version)
        out: dict[str, Any] = {
            "kind": "response",
            "api": api_name(api_key),
            "api_key": api_key,
            "api_version": api_version,
            "correlation_id": resp.correlation_id,
        }
    else:
        req = decode_request(frame)
        header, body = req.header, req.body
        api_key, api_version = req.api_key, req.api_version
        hc, bc = request_codecs(api_key, api_version)
        out = {
            "kind": "request",
            "api": api_name(api_key),
            "api_key": api_key,
            "api_version": api_version,
            "correlation_id": req.correlation_id,
            "client_id": _render_text(req.client_id),
        }
    renderer = _Renderer(frame, response)
    out["header_version"] = hc.version
    out["header"] = renderer.struct(header.to_dict(hc.version), hc.message.root, hc.version, "header")
    out["body"] = renderer.struct(body.to_dict(api_version), bc.message.root, api_version, bc.name)
    return out


def dissect(data: bytes, *, response: bool = False, api_key: int | None = None,
            api_version: int | None = None) -> dict[str, Any]:
    """Decode one frame, with or without its 4-byte size prefix, into JSON-ready dicts.

    A response needs the api key and version of its request. Offsets in the DecodeErrors raised
    here count from the start of ``data``, so they match the bytes the user pasted. A prefixed frame
    followed by more bytes is decoded, and the extra bytes are counted in ``trailing_bytes``; a
    prefixed frame cut short, or bytes of another protocol, get an error that says so.
    """
    if not data:
        raise DecodeError("no bytes to decode", 0, "input")
    size = _SIZE.unpack_from(data)[0] if len(data) >= 4 else None
    follow = len(data) - 4
    if size is not None and 0 <= size <= follow:
        try:
            out = {"size_prefix": True, **_dissect_frame(data[4:4 + size], response, api_key, api_version)}
            if size < follow:
                out["trailing_bytes"] = follow - size
            return out
        except DecodeError as first:
            # A response's correlation id can equal the frame's length by chance; try it unprefixed.
            try:
                return {"size_prefix": False, **_dissect_frame(data, response, api_key, api_version)}
            except DecodeError:
                pass
            offset = None if first.offset is None else first.offset + 4
            raise DecodeError(_with_hint(first.reason, data), offset, first.path) from None
    try:
        return {"size_prefix": False, **_dissect_frame(data, response, api_key, api_version)}
    except DecodeError as e:
        unprefixed = e
    what = _describe_header(data[4:], response, api_key, api_version)
    if (size is not None and follow < size <= 100 * 1024 * 1024 and what
            and not isinstance(unprefixed, TrailingBytesError)):
        # Read without a prefix it makes no sense, and its first four bytes promise more than follows
        # before a header kproxy knows: a frame cut short (a partial copy).
        try:
            _dissect_frame(data[4:], response, api_key, api_version)
        except DecodeError as inner:
            offset = None if inner.offset is None else inner.offset + 4
            raise DecodeError(f"the input is {what}frame of {size} bytes cut short: only {follow} bytes "
                              f"follow its size prefix ({inner.reason})", offset, inner.path) from None
    raise DecodeError(_with_hint(unprefixed.reason, data), unprefixed.offset, unprefixed.path) from None


def _describe_header(frame: bytes, response: bool, api_key: int | None, api_version: int | None) -> str:
    """``"an api_versions v3 request "`` from a request header, or ``""`` when it names no known API."""
    if response:
        return f"a {api_name(api_key)} v{api_version} response " if api_key is not None else ""
    if len(frame) < 4:
        return ""
    key, version = struct.unpack_from(">hh", frame)
    if key in apis():
        return f"a{'n' if api_name(key)[0] in 'aeiou' else ''} {api_name(key)} v{version} request "
    return ""


def _with_hint(reason: str, data: bytes) -> str:
    hint = foreign_protocol(data[:4])
    return f"{reason}; {hint}" if hint else reason


# --------------------------------------------------------------------------------------------------
# Codec source


def resolve_api(text: str) -> ApiSpec:
    """An API by key (``0``), snake_case name (``api_versions``) or Kafka's name (``ApiVersions``)."""
    table = apis()
    if text.strip().isdigit():
        api = table.get(int(text))
        if api is None:
            raise UnsupportedVersionError(f"no api with key {text} in kproxy's schema")
        return api
    wanted = re.sub(r"[\s_-]", "", text).lower()
    for api in table.values():
        if api.name.replace("_", "") == wanted:
            return api
    raise UnsupportedVersionError(f"no api named {text!r} in kproxy's schema")


def codec_text(api_text: str, version: int, kind: str = "request") -> str:
    """The generated decoder and encoder source of one API's request or response at ``version``."""
    api = resolve_api(api_text)
    spec = api.request if kind == "request" else api.response
    assert spec is not None
    if version not in spec.versions:
        raise UnsupportedVersionError(f"{api.name} {kind} v{version} is not defined (kproxy has v{spec.versions})")
    codec = get_codec(spec, version)
    return (f"# {codec.name} {kind} (api key {api.key}), generated by kproxy.protocol.compiler\n"
            f"# {codec_implementation()}; arrays of {codec.lazy_min_items} or more structs decode lazily\n"
            f"{codec.source}{compiled_text(codec)}")
