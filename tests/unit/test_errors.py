"""The Kafka error-code table, checked against kio's independent enum, and the exception tree."""

from __future__ import annotations

import dataclasses

import pytest
from kio.schema.errors import ErrorCode as KioErrorCode

from kproxy.config import ConfigError
from kproxy.protocol import errors
from kproxy.protocol.errors import (
    ERROR_CODES,
    ERROR_CODES_BY_NAME,
    DecodeError,
    EncodeError,
    ErrorCode,
    FrameError,
    KProxyError,
    ProtocolError,
    RecordsError,
    UnsupportedVersionError,
    error_name,
    is_retriable,
)

# SHARE_SESSION_LIMIT_REACHED, the highest code in Kafka 4.x's Errors enum.
HIGHEST_KAFKA_CODE = 133


# -- the table against kio ----------------------------------------------------------------------


@pytest.mark.parametrize("kio_code", list(KioErrorCode), ids=lambda c: c.name)
def test_every_kio_code_is_in_the_table_with_its_name_and_retriability(kio_code: KioErrorCode) -> None:
    entry = ERROR_CODES.get(int(kio_code))
    assert entry is not None, f"{kio_code.name} ({int(kio_code)}) missing from ERROR_CODES"
    assert entry.code == int(kio_code)
    assert entry.name == kio_code.name.upper()
    # kio records Kafka's "Retriable" column for every code.
    assert entry.retriable is kio_code.retriable


def test_table_has_nothing_kio_does_not_know() -> None:
    # Not a law (kio may lag Kafka), but today the two agree exactly; a code only here is a typo.
    assert set(ERROR_CODES) == {int(c) for c in KioErrorCode}


# -- the table on its own -----------------------------------------------------------------------


def test_codes_run_without_gaps_from_minus_one_to_the_highest_kafka_code() -> None:
    assert sorted(ERROR_CODES) == list(range(-1, HIGHEST_KAFKA_CODE + 1))


def test_each_entry_is_keyed_by_its_own_code_and_names_are_unique() -> None:
    for code, entry in ERROR_CODES.items():
        assert entry.code == code
    names = [e.name for e in ERROR_CODES.values()]
    assert len(names) == len(set(names))
    assert {e.name: e for e in ERROR_CODES.values()} == dict(ERROR_CODES_BY_NAME)


def test_names_are_upper_snake_and_descriptions_are_present() -> None:
    for entry in ERROR_CODES.values():
        assert entry.name.replace("_", "").isalpha() and entry.name == entry.name.upper(), entry.name
        assert entry.description.strip(), entry.name
        assert entry.description.endswith("."), entry.name


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        ERROR_CODES[999] = ErrorCode(999, "X", False, "x.")  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ERROR_CODES[0].retriable = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("code", "retriable"),
    [
        (errors.NOT_LEADER_OR_FOLLOWER, True),
        (errors.REQUEST_TIMED_OUT, True),
        (errors.LEADER_NOT_AVAILABLE, True),
        (errors.UNKNOWN_TOPIC_OR_PARTITION, True),
        (errors.CORRUPT_MESSAGE, True),
        (errors.NETWORK_EXCEPTION, True),
        (errors.NOT_COORDINATOR, True),
        (errors.THROTTLING_QUOTA_EXCEEDED, True),
        (51, True),  # CONCURRENT_TRANSACTIONS: retriable since Kafka made its exception a RetriableException
        (133, True),  # SHARE_SESSION_LIMIT_REACHED
        (errors.TOPIC_AUTHORIZATION_FAILED, False),
        (errors.UNSUPPORTED_VERSION, False),
        (errors.POLICY_VIOLATION, False),
        (errors.INVALID_REQUEST, False),
        (errors.UNKNOWN_SERVER_ERROR, False),
        (errors.NONE, False),
        (27, False),  # REBALANCE_IN_PROGRESS: the member must rejoin, not retry
        (90, False),  # PRODUCER_FENCED
        (120, False),  # TRANSACTION_ABORTABLE
    ],
    ids=error_name,
)
def test_retriable_facts(code: int, retriable: bool) -> None:
    assert is_retriable(code) is retriable


def test_error_name_for_known_and_unknown_codes() -> None:
    assert error_name(6) == "NOT_LEADER_OR_FOLLOWER"
    assert error_name(-1) == "UNKNOWN_SERVER_ERROR"
    assert error_name(0) == "NONE"
    assert error_name(HIGHEST_KAFKA_CODE + 1) == f"UNKNOWN_ERROR_{HIGHEST_KAFKA_CODE + 1}"
    assert error_name(-2) == "UNKNOWN_ERROR_-2"
    assert error_name(32767) == "UNKNOWN_ERROR_32767"


def test_unknown_codes_are_not_retriable() -> None:
    # Kafka reads a code it does not know as UNKNOWN_SERVER_ERROR, which is not retriable.
    assert is_retriable(HIGHEST_KAFKA_CODE + 1) is False
    assert is_retriable(-2) is False


def test_module_constants_match_the_table() -> None:
    constants = {
        name: value
        for name, value in vars(errors).items()
        if name.isupper() and isinstance(value, int) and not isinstance(value, bool)
    }
    assert len(constants) >= 30  # the codes the proxy answers with
    for name, value in constants.items():
        assert ERROR_CODES_BY_NAME[name].code == value, name


# -- the exception tree -------------------------------------------------------------------------


def test_decode_error_carries_offset_and_path_and_names_both() -> None:
    err = DecodeError("array length exceeds remaining bytes", offset=17, path="produce.v9.topic_data[0]")
    assert err.reason == "array length exceeds remaining bytes"
    assert err.offset == 17
    assert err.path == "produce.v9.topic_data[0]"
    text = str(err)
    assert "array length exceeds remaining bytes" in text
    assert "produce.v9.topic_data[0]" in text
    assert "offset 17" in text


def test_decode_error_offset_zero_is_still_reported() -> None:
    assert "offset 0" in str(DecodeError("bad size", offset=0))


def test_decode_error_without_location_is_just_the_reason() -> None:
    err = DecodeError("truncated")
    assert err.offset is None and err.path is None
    assert str(err) == "truncated"


@pytest.mark.parametrize("cls", [FrameError, UnsupportedVersionError, RecordsError])
def test_specific_decode_errors_are_decode_errors(cls: type[DecodeError]) -> None:
    err = cls("nope", offset=4, path="fetch.v12")
    assert isinstance(err, DecodeError)
    assert isinstance(err, ProtocolError)
    assert isinstance(err, KProxyError)
    assert err.offset == 4 and err.path == "fetch.v12"
    with pytest.raises(DecodeError):
        raise err


def test_encode_error_is_a_protocol_error_but_not_a_decode_error() -> None:
    assert issubclass(EncodeError, ProtocolError)
    assert not issubclass(EncodeError, DecodeError)


def test_config_error_names_file_and_line() -> None:
    err = ConfigError("unknown key 'acks_max'", file="rules/produce.yaml", line=12)
    assert err.file == "rules/produce.yaml" and err.line == 12
    assert str(err).startswith("rules/produce.yaml:12: ")
    assert "unknown key 'acks_max'" in str(err)
    assert isinstance(err, KProxyError)
    assert not isinstance(err, ProtocolError)


def test_config_error_with_file_only_or_nothing() -> None:
    assert str(ConfigError("empty file", file="kproxy.yaml")) == "kproxy.yaml: empty file"
    assert str(ConfigError("no listeners")) == "no listeners"
