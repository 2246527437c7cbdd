"""``kproxy decode``: hex in every shape people paste, raw files, responses, codec source, clear
one-line errors with offset and field path, and SASL secrets that never reach the output."""

from __future__ import annotations

import base64
import io
import json
import struct
import sys

import pytest

from kproxy.cli import main
from kproxy.protocol.compiler import get_codec
from kproxy.protocol.messages import (
    Request,
    Response,
    api_by_name,
    body_class,
    encode_request_frame,
    encode_response_frame,
)
from kproxy.protocol.primitives import write_uvarint
from kproxy.protocol.records import Compression, build_batch
from tests.protocol.test_golden import METADATA_V0_RESPONSE, PRODUCE_V0_REQUEST

SECRET = b"\x00user\x00secret-password"  # a SASL/PLAIN token: authzid, user, password


def decode(capsys, monkeypatch, *argv: str, stdin: str | None = None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(["decode", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def check_produce_v0(result: dict, size_prefix: bool) -> None:
    assert result["size_prefix"] is size_prefix
    assert (result["kind"], result["api"], result["api_key"], result["api_version"]) == ("request", "produce", 0, 0)
    assert (result["correlation_id"], result["client_id"]) == (1, "foo")
    assert result["header"] == {"request_api_key": 0, "request_api_version": 0, "correlation_id": 1, "client_id": "foo"}
    assert (result["body"]["acks"], result["body"]["timeout_ms"]) == (1, 1000)
    topic = result["body"]["topic_data"][0]
    assert topic["name"] == "test"
    records = topic["partition_data"][0]["records"]
    assert records["bytes"] == 37
    (message,) = records["batches"]
    assert message == {
        "offset": 0, "magic": 0, "crc": "0x73acf77c", "crc_valid": True, "attributes": 0,
        "compression": "none", "key": None, "value": "hello world",
    }


# --------------------------------------------------------------------------------------------------
# Hex input


def spaced(data: bytes) -> str:
    return " ".join(f"{b:02x}" for b in data)


def c_array(data: bytes) -> str:
    rows = [", ".join(f"0x{b:x}" for b in data[i : i + 8]) for i in range(0, len(data), 8)]
    return ",\n".join(rows) + "\n"


def colon_rows(data: bytes) -> str:
    return "\n".join(":".join(f"{b:02x}" for b in data[i : i + 4]) + ":" for i in range(0, len(data), 4))


def guide_dump(data: bytes) -> str:
    """The protocol guide's layout: ``0000:`` offsets, 16 spaced bytes a line."""
    return "\n".join(f"{i:04x}: {spaced(data[i : i + 16])}" for i in range(0, len(data), 16)) + "\n"


def _ascii(chunk: bytes) -> str:
    return "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)


def xxd_dump(data: bytes) -> str:
    """xxd's layout: 2-byte groups, then the bytes as text, which may itself look like hex."""
    lines = []
    for i in range(0, len(data), 16):
        chunk = data[i : i + 16]
        groups = " ".join(chunk[j : j + 2].hex() for j in range(0, len(chunk), 2))
        lines.append(f"{i:08x}: {groups:<39}  {_ascii(chunk)}")
    return "\n".join(lines) + "\n"


def hexdump_c(data: bytes) -> str:
    """``hexdump -C``: offsets without colons, bars around the text, a final offset line."""
    lines = []
    for i in range(0, len(data), 16):
        chunk = data[i : i + 16]
        left, right = spaced(chunk[:8]), spaced(chunk[8:])
        lines.append(f"{i:08x}  {left:<23}  {right:<23}  |{_ascii(chunk)}|")
    lines.append(f"{len(data):08x}")
    return "\n".join(lines) + "\n"


HEX_SHAPES = {
    "contiguous": lambda d: d.hex(),
    "spaced": spaced,
    "c-array": c_array,
    "colon-separated": colon_rows,
    "guide-dump": guide_dump,
    "xxd": xxd_dump,
    "hexdump-C": hexdump_c,
}


@pytest.mark.parametrize("shape", HEX_SHAPES, ids=str)
def test_every_hex_shape_decodes_like_the_raw_bytes(capsys, monkeypatch, tmp_path, shape):
    raw_file = tmp_path / "frame.bin"
    raw_file.write_bytes(PRODUCE_V0_REQUEST)
    rc, expected, _ = decode(capsys, monkeypatch, "--raw", str(raw_file))
    assert rc == 0

    rc, out, err = decode(capsys, monkeypatch, stdin=HEX_SHAPES[shape](PRODUCE_V0_REQUEST))
    assert (rc, err) == (0, "")
    assert out == expected
    check_produce_v0(json.loads(out), size_prefix=True)


def test_xxd_text_column_that_looks_like_hex_is_not_data(capsys, monkeypatch):
    # The last line's text column reads "ad", which is also hex; it must not become a trailing byte.
    frame = PRODUCE_V0_REQUEST.replace(b"hello world", b"hello wobad")
    assert xxd_dump(frame).splitlines()[-1].endswith("  ad")
    rc, out, err = decode(capsys, monkeypatch, stdin=xxd_dump(frame))
    assert (rc, err) == (0, "")
    (message,) = json.loads(out)["body"]["topic_data"][0]["partition_data"][0]["records"]["batches"]
    assert message["value"] == "hello wobad"


def test_hex_with_spaces_0x_and_newlines_from_stdin(capsys, monkeypatch):
    text = "  0x00 0x00 0x00 0x4e\n\n" + " ".join(f"0x{b:02X}" for b in PRODUCE_V0_REQUEST[4:40]) + "\n"
    text += "\t" + PRODUCE_V0_REQUEST[40:].hex() + "  \n"
    rc, out, err = decode(capsys, monkeypatch, "-", stdin=text)
    assert (rc, err) == (0, "")
    check_produce_v0(json.loads(out), size_prefix=True)


def test_without_the_size_prefix(capsys, monkeypatch):
    rc, out, err = decode(capsys, monkeypatch, stdin=spaced(PRODUCE_V0_REQUEST[4:]))
    assert (rc, err) == (0, "")
    check_produce_v0(json.loads(out), size_prefix=False)


def test_hex_with_comments_like_an_annotated_dump(capsys, monkeypatch):
    annotated = "00 00 00 4e  # size\n00 00  # api key\n" + spaced(PRODUCE_V0_REQUEST[6:]) + "  # the rest\n"
    rc, out, _ = decode(capsys, monkeypatch, stdin=annotated)
    assert rc == 0
    check_produce_v0(json.loads(out), size_prefix=True)


def test_text_that_is_not_hex_names_its_line(capsys, monkeypatch):
    rc, out, err = decode(capsys, monkeypatch, stdin="00 00\n00 zz 4e\n")
    assert (rc, out) == (2, "")
    assert "'zz' is not hex" in err
    assert "input line 2" in err


def test_raw_file(capsys, monkeypatch, tmp_path):
    path = tmp_path / "produce.bin"
    path.write_bytes(PRODUCE_V0_REQUEST[4:])
    rc, out, err = decode(capsys, monkeypatch, "--raw", str(path))
    assert (rc, err) == (0, "")
    check_produce_v0(json.loads(out), size_prefix=False)


def test_missing_file(capsys, monkeypatch, tmp_path):
    rc, out, err = decode(capsys, monkeypatch, str(tmp_path / "nope.hex"))
    assert (rc, out) == (2, "")
    assert "cannot read" in err


# --------------------------------------------------------------------------------------------------
# Responses


def test_response(capsys, monkeypatch):
    framed = struct.pack(">i", len(METADATA_V0_RESPONSE)) + METADATA_V0_RESPONSE
    rc, out, err = decode(capsys, monkeypatch, "--response", "--api-key", "3", "--api-version", "0",
                          stdin=framed.hex())
    assert (rc, err) == (0, "")
    result = json.loads(out)
    assert (result["kind"], result["api"], result["api_version"]) == ("response", "metadata", 0)
    assert result["correlation_id"] == 2
    assert result["body"]["brokers"] == [{"node_id": 1, "host": "localhost", "port": 9092}]
    assert result["body"]["topics"][0]["partitions"][0]["isr_nodes"] == [1]


def test_response_needs_api_key_and_version(capsys, monkeypatch):
    rc, out, err = decode(capsys, monkeypatch, "--response", stdin=METADATA_V0_RESPONSE.hex())
    assert (rc, out) == (2, "")
    assert "--api-key" in err


# --------------------------------------------------------------------------------------------------
# Records and bytes


def test_record_batch_keys_and_values_are_text_or_base64(capsys, monkeypatch):
    Produce = body_class(0, "request")
    batch = build_batch(
        [(b"\x00\x01", b"plain text", [("trace", b"\xff\xfe")]), (None, "héllo".encode())],
        base_timestamp=1_700_000_000_000,
    )
    body = Produce(acks=-1, timeout_ms=30000, topic_data=[Produce.TopicProduceData(
        name="events", partition_data=[Produce.PartitionProduceData(index=3, records=batch)]
    )])
    frame = b"".join(bytes(p) for p in encode_request_frame(Request.build(0, 3, 9, "app", body)))
    rc, out, _ = decode(capsys, monkeypatch, stdin=frame.hex())
    assert rc == 0
    (b,) = json.loads(out)["body"]["topic_data"][0]["partition_data"][0]["records"]["batches"]
    assert (b["magic"], b["record_count"], b["crc_valid"], b["compression"]) == (2, 2, True, "none")
    first, second = b["records"]
    assert first["key"] == {"base64": base64.b64encode(b"\x00\x01").decode()}
    assert first["value"] == "plain text"
    assert first["headers"] == [{"key": "trace", "value": {"base64": base64.b64encode(b"\xff\xfe").decode()}}]
    assert (second["offset"], second["key"], second["value"]) == (1, None, "héllo")


def test_fetch_response_with_a_compressed_batch_and_a_cut_tail(capsys, monkeypatch):
    Fetch = body_class(1, "response")
    batch = build_batch([(b"k", b"v" * 100)] * 3, compression=Compression.GZIP, base_offset=40)
    records = batch + batch[:30]  # brokers cut the last batch at max_bytes
    body = Fetch(responses=[Fetch.FetchableTopicResponse(topic="events", partitions=[
        Fetch.PartitionData(partition_index=0, high_watermark=43, records=records)
    ])])
    frame = b"".join(bytes(p) for p in encode_response_frame(Response.build(1, 11, 12, body)))
    rc, out, err = decode(capsys, monkeypatch, "--response", "--api-key", "1", "--api-version", "11",
                          stdin=frame.hex())
    assert (rc, err) == (0, "")
    fetched = json.loads(out)["body"]["responses"][0]["partitions"][0]["records"]
    assert (fetched["bytes"], fetched["truncated_bytes"]) == (len(records), 30)
    (b,) = fetched["batches"]
    assert (b["compression"], b["crc_valid"]) == ("gzip", True)
    assert [(r["offset"], r["key"], r["value"]) for r in b["records"]] == [
        (40 + i, "k", "v" * 100) for i in range(3)
    ]


def test_a_bad_crc_is_shown_not_fatal(capsys, monkeypatch):
    frame = PRODUCE_V0_REQUEST.replace(b"hello world", b"hello_world")
    rc, out, _ = decode(capsys, monkeypatch, stdin=frame.hex())
    assert rc == 0
    (message,) = json.loads(out)["body"]["topic_data"][0]["partition_data"][0]["records"]["batches"]
    assert message["crc_valid"] is False


# --------------------------------------------------------------------------------------------------
# Errors


def test_malformed_frame_gives_offset_and_field_path(capsys, monkeypatch):
    bad = bytearray(PRODUCE_V0_REQUEST)
    bad[4 + 23 : 4 + 25] = struct.pack(">h", 64)  # the topic name claims 64 bytes
    rc, out, err = decode(capsys, monkeypatch, stdin=bad.hex())
    assert (rc, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("kproxy decode: ")
    assert "produce.v0.topic_data[0].name" in err
    assert "offset 29" in err  # the name's bytes start at 25 in the frame, 29 with the size prefix


def test_malformed_records_give_the_records_path(capsys, monkeypatch):
    # The message claims one byte more than the message set holds; a request is never cut short.
    frame = PRODUCE_V0_REQUEST.replace(struct.pack(">qi", 0, 25), struct.pack(">qi", 0, 26))
    rc, out, err = decode(capsys, monkeypatch, stdin=frame.hex())
    assert (rc, out) == (2, "")
    assert "produce.v0.topic_data[0].partition_data[0].records" in err
    assert "offset 45" in err  # where the records field starts, counting the size prefix


def test_unknown_api_key(capsys, monkeypatch):
    rc, out, err = decode(capsys, monkeypatch, stdin="7f ff 00 00 00 00 00 01 ff ff")
    assert (rc, out) == (2, "")
    assert "unknown api key 32767" in err
    assert "offset 0" in err


def test_a_frame_cut_short_says_so(capsys, monkeypatch):
    rc, _, err = decode(capsys, monkeypatch, stdin=PRODUCE_V0_REQUEST[:60].hex())
    assert rc == 2
    assert "frame of 78 bytes cut short" in err


# --------------------------------------------------------------------------------------------------
# --show-codec


def test_show_codec_by_name_and_by_key(capsys, monkeypatch):
    rc, by_name, _ = decode(capsys, monkeypatch, "--show-codec", "produce", "3")
    assert rc == 0
    source = get_codec(api_by_name("produce").request, 3).source
    assert source in by_name
    assert "def d_ProduceRequest(buf, pos, end):" in by_name
    rc, by_key, _ = decode(capsys, monkeypatch, "--show-codec", "0", "3")
    assert (rc, by_key) == (0, by_name)
    rc, kafka_name, _ = decode(capsys, monkeypatch, "--show-codec", "ApiVersions", "3", "--kind", "response")
    assert rc == 0
    assert get_codec(api_by_name("api_versions").response, 3).source in kafka_name


def test_show_codec_errors(capsys, monkeypatch):
    rc, out, err = decode(capsys, monkeypatch, "--show-codec", "no_such_api", "0")
    assert (rc, out) == (2, "")
    assert "no_such_api" in err
    rc, out, err = decode(capsys, monkeypatch, "--show-codec", "produce", "99")
    assert (rc, out) == (2, "")
    assert "v99" in err


# --------------------------------------------------------------------------------------------------
# Secrets


def sasl_authenticate_v2_request() -> bytes:
    return b"".join([
        struct.pack(">hhi", 36, 2, 5),  # SaslAuthenticate v2, correlation_id 5 (header v2)
        struct.pack(">h", 2), b"c1",  # client_id
        b"\x00",  # header tagged fields
        write_uvarint(len(SECRET) + 1), SECRET,  # auth_bytes: compact bytes
        b"\x00",  # body tagged fields
    ])


def assert_no_secret(text: str) -> None:
    assert "secret-password" not in text
    assert base64.b64encode(SECRET).decode() not in text
    assert base64.b64encode(b"secret-password").decode()[:12] not in text
    assert SECRET.hex() not in text


def test_sasl_authenticate_request_is_redacted(capsys, monkeypatch):
    rc, out, err = decode(capsys, monkeypatch, stdin=sasl_authenticate_v2_request().hex())
    assert (rc, err) == (0, "")
    result = json.loads(out)
    assert result["api"] == "sasl_authenticate"
    assert result["body"]["auth_bytes"] == f"<redacted {len(SECRET)} bytes>"
    assert_no_secret(out)


def test_sasl_authenticate_response_is_redacted(capsys, monkeypatch):
    frame = b"".join([
        struct.pack(">i", 5), b"\x00",  # correlation_id, header tagged fields (header v1)
        struct.pack(">h", 0), b"\x00",  # error_code, error_message: null
        write_uvarint(len(SECRET) + 1), SECRET,  # auth_bytes
        struct.pack(">q", 3_600_000), b"\x00",  # session_lifetime_ms, tagged fields
    ])
    rc, out, _ = decode(capsys, monkeypatch, "--response", "--api-key", "36", "--api-version", "2",
                        stdin=frame.hex())
    assert rc == 0
    assert json.loads(out)["body"]["session_lifetime_ms"] == 3_600_000
    assert_no_secret(out)


def test_a_malformed_sasl_frame_does_not_leak_the_token(capsys, monkeypatch):
    rc, out, err = decode(capsys, monkeypatch, stdin=(sasl_authenticate_v2_request() + b"!").hex())
    assert rc == 2
    assert "trailing" in err
    assert_no_secret(out + err)


# -- hints for the inputs people get wrong

README_API_VERSIONS = "00 00 00 17 00 12 00 03 00 00 00 07 00 02 63 31 00 05 6b 63 61 74 04 31 2e 37 00"


def test_empty_input_is_a_clean_error():
    assert main(["decode", "--raw", "/dev/null"]) == 2


def test_a_frame_cut_short_is_reported_as_such_not_as_another_api(capsys, monkeypatch):
    cut = " ".join(README_API_VERSIONS.split()[:-4])        # four bytes lost in the copy
    rc, _, err = decode(capsys, monkeypatch, stdin=cut)
    assert rc == 2
    assert "api_versions v3 request frame of 23 bytes cut short" in err
    assert "only 19 bytes follow its size prefix" in err
    assert "produce" not in err                              # not read as "produce v23"


def test_bytes_after_the_frame_are_decoded_and_noted(capsys, monkeypatch):
    rc, out, err = decode(capsys, monkeypatch, stdin=README_API_VERSIONS + " 00 00 00 05")
    assert rc == 0
    result = json.loads(out)
    assert result["api"] == "api_versions" and result["trailing_bytes"] == 4
    assert "4 more bytes follow the frame" in err


@pytest.mark.parametrize(("data", "word"), [
    (b"GET /metrics HTTP/1.1\r\nHost: kproxy\r\n\r\n", "HTTP"),
    (bytes.fromhex("160301020001000001fc0303") + b"\x00" * 40, "TLS"),
])
def test_http_and_tls_bytes_get_a_hint(capsys, monkeypatch, data, word):
    rc, _, err = decode(capsys, monkeypatch, stdin=data.hex())
    assert rc == 2
    assert f"look like {'a TLS handshake' if word == 'TLS' else 'HTTP'}" in err


def test_the_proxys_frame_limit_error_names_the_setting_and_spots_http():
    from kproxy.protocol.errors import DecodeError
    from kproxy.protocol.framing import FrameReader

    r = FrameReader(max_frame_size=1024, limit_name="limits.max_frame_size")
    r.feed(b"GET / HTTP/1.1\r\n")
    with pytest.raises(DecodeError) as e:
        r.next_frame()
    assert "(limits.max_frame_size)" in str(e.value) and "look like HTTP" in str(e.value)
