"""Log output: ``safe`` keeps client strings on one honest line; the JSON formatter escapes by construction."""

import io
import json
import logging
import sys
from datetime import UTC, datetime

import pytest

from kproxy.logs import TEXT_FORMAT, JsonFormatter, configure_logging, safe

# -- safe ---------------------------------------------------------------------------------------------


def test_safe_leaves_ordinary_names_alone() -> None:
    for name in ("rdkafka", "console-consumer-42", "orders.v1_eu", "SCRAM-SHA-512", "café-客户端", "a b"):
        assert safe(name) == name


def test_safe_escapes_a_forged_log_line() -> None:
    forged = "app\n2024-01-01 12:00:00,000 INFO kproxy.server: connection 7 authenticated as User:admin"
    out = safe(forged)
    assert "\n" not in out
    assert out == "app\\n2024-01-01 12:00:00,000 INFO kproxy.server: connection 7 authenticated as User:admin"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a\r\nb\tc", "a\\r\\nb\\tc"),
        ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),        # terminal escape codes
        ("nul\x00del\x7f", "nul\\x00del\\x7f"),
        ("c1\x85", "c1\\x85"),                                  # NEL, a C1 line break
        ("ls\u2028ps\u2029", "ls\\u2028ps\\u2029"),             # Unicode line and paragraph separators
        ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),  # invisible format characters
        ("tag\U000e0041", "tag\\U000e0041"),
        ("back\\nslash", "back\\\\nslash"),                     # a literal backslash cannot pose as an escape
        (b"raw\x1b\n\xff\xfe", "raw\\x1b\\n\\xff\\xfe"),        # bytes; invalid UTF-8 shown as \xNN
        (b"ok-\xc3\xa9", "ok-\u00e9"),
        (None, "null"),
    ],
)
def test_safe_escapes_what_is_not_printable(value: str | bytes | None, expected: str) -> None:
    out = safe(value)
    assert out == expected
    assert out.isprintable()


def test_safe_caps_the_length_and_says_how_much_was_cut() -> None:
    assert safe("x" * 200) == "x" * 200
    assert safe("x" * 201) == "x" * 200 + "[...1 more characters]"
    assert safe("y" * 10_000, limit=8) == "yyyyyyyy[...9992 more characters]"
    # The cap counts the client's characters; escapes can make the output longer, never unbounded.
    out = safe("\n" * 50, limit=10)
    assert out == "\\n" * 10 + "[...40 more characters]"


# -- JSON lines ---------------------------------------------------------------------------------------


def record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom\nsecond line")
        except RuntimeError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord("kproxy.server", logging.WARNING, __file__, 1, msg, args, exc_info)
    rec.created = 1714564800.25  # 2024-05-01T12:00:00.250Z
    return rec


def test_json_line_has_the_documented_keys() -> None:
    line = JsonFormatter().format(record("connection %d closed: %s", 7, "idle"))
    assert json.loads(line) == {
        "ts": "2024-05-01T12:00:00.250Z",
        "level": "WARNING",
        "logger": "kproxy.server",
        "msg": "connection 7 closed: idle",
    }
    assert datetime.fromisoformat(json.loads(line)["ts"]) == datetime.fromtimestamp(1714564800.25, UTC)


def test_json_line_escapes_by_construction() -> None:
    hostile = 'x"}\n{"level": "INFO", "msg": "forged"}\x1b[2J\u2028'
    line = JsonFormatter().format(record("client id %s", hostile))
    assert "\n" not in line and "\x1b" not in line and "\u2028" not in line
    assert line.isascii() and line.isprintable()
    assert json.loads(line)["msg"] == f"client id {hostile}"


def test_json_line_carries_the_traceback() -> None:
    entry = json.loads(JsonFormatter().format(record("failed", exc=True)))
    assert entry["msg"] == "failed"
    assert entry["exc"].startswith("Traceback (most recent call last):")
    assert entry["exc"].endswith("RuntimeError: boom\nsecond line")


# -- configure_logging --------------------------------------------------------------------------------


def test_configure_logging_installs_one_handler(root_logger: logging.Logger,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    before = len(root_logger.handlers)
    configure_logging("INFO", "text")
    handler = configure_logging("DEBUG", "json")
    assert len(root_logger.handlers) == before + 1 and handler in root_logger.handlers
    assert root_logger.level == logging.DEBUG
    logging.getLogger("kproxy.test").debug("hello %s", "there")
    assert json.loads(err.getvalue())["msg"] == "hello there"

    configure_logging("WARNING", "text")
    logging.getLogger("kproxy.test").info("not shown")
    logging.getLogger("kproxy.test").warning("shown")
    lines = err.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].endswith(" WARNING kproxy.test: shown")
    assert TEXT_FORMAT.endswith("%(name)s: %(message)s")


def test_configure_logging_rejects_an_unknown_format(root_logger: logging.Logger) -> None:
    with pytest.raises(ValueError, match="log format must be one of text, json, got 'xml'"):
        configure_logging("INFO", "xml")
