"""The project's exception tree and the table of Kafka error codes.

Every failure kproxy raises is a ``KProxyError``; protocol failures carry the byte offset and the
field path where they happened. This module must not import anything that does I/O.

    KProxyError
    ├── ProtocolError
    │   ├── DecodeError            bytes that are not a valid Kafka message (offset, path)
    │   │   ├── FrameError         a size prefix that is negative or over the configured cap
    │   │   ├── UnsupportedVersionError   an api key or version the schema does not define
    │   │   ├── TrailingBytesError  bytes left over after a whole message
    │   │   └── RecordsError       a record batch that fails its CRC, size or codec checks
    │   └── EncodeError            a message that cannot be encoded (bad value for its type)
    ├── AddressMapError            a broker that cannot be given a port (kproxy.proxy.addresses)
    └── LocatedError               an error in a file kproxy reads (file, line, reason)
        ├── SchemaError            a .kschema file that does not parse
        └── ConfigError            invalid configuration or rules (kproxy.config: the layer above)
            ├── SettingError       one setting breaks its rule (path); raised by the config classes
            └── RuleError          policy rule files that do not load: every problem with file:line:column
                                   and the rule's name (kproxy.policy.loader)
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Final


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


class TrailingBytesError(DecodeError):
    """A whole message was decoded and bytes are left over after it."""


class RecordsError(DecodeError):
    """A record batch or legacy message set is corrupt, too large once decompressed, or unreadable."""


class EncodeError(ProtocolError):
    """A message holds a value that its field's type cannot carry in the requested version."""


class LocatedError(KProxyError):
    """An error in a file kproxy reads; ``file`` and ``line`` point at the offending text when known,
    and the message starts with ``file:line:``."""

    def __init__(self, reason: str, file: str | None = None, line: int | None = None) -> None:
        self.reason = reason
        self.file = file
        self.line = line
        loc = file or ""
        if file and line is not None:
            loc = f"{file}:{line}"
        super().__init__(f"{loc}: {reason}" if loc else reason)


class SchemaError(LocatedError):
    """A ``.kschema`` file that does not follow FORMAT.md. Raised by ``kproxy.protocol.schema`` (a
    fault of kproxy's own files, not of a user's configuration)."""


# --------------------------------------------------------------------------------------------------
# Kafka protocol error codes
# --------------------------------------------------------------------------------------------------
#
# Every code Apache Kafka defines up to 4.x, from -1 to SHARE_SESSION_LIMIT_REACHED (133). Names are
# those of Kafka's ``Errors`` enum; ``retriable`` is true exactly when Kafka's exception class for the
# code extends ``RetriableException``. Codes are fixed forever once released; names may be renamed
# upstream (6 was NOT_LEADER_FOR_PARTITION before KIP-392), so match on the number, not the name.


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorCode:
    """One Kafka error code: its number, Kafka's name for it, and whether clients retry it."""

    code: int
    name: str
    retriable: bool
    description: str


# One row per code reads as a table; the formatter would split most rows over five lines.
# fmt: off
_TABLE: Final[tuple[ErrorCode, ...]] = (
    ErrorCode(-1, "UNKNOWN_SERVER_ERROR", False, "The broker hit an unexpected internal failure while handling the request."),
    ErrorCode(0, "NONE", False, "Success; no error."),
    ErrorCode(1, "OFFSET_OUT_OF_RANGE", False, "The requested offset lies outside the range the partition's log currently holds."),
    ErrorCode(2, "CORRUPT_MESSAGE", True, "A record or batch failed its CRC or size checks, or is otherwise malformed (e.g. a null key on a compacted topic)."),
    ErrorCode(3, "UNKNOWN_TOPIC_OR_PARTITION", True, "The broker does not host the named topic-partition."),
    ErrorCode(4, "INVALID_FETCH_SIZE", False, "The fetch size in the request is not acceptable."),
    ErrorCode(5, "LEADER_NOT_AVAILABLE", True, "The partition has no leader at the moment, typically during an election."),
    ErrorCode(6, "NOT_LEADER_OR_FOLLOWER", True, "The broker is not the leader (or not a replica) for the partition; the client should refresh metadata."),
    ErrorCode(7, "REQUEST_TIMED_OUT", True, "The request did not complete within its timeout."),
    ErrorCode(8, "BROKER_NOT_AVAILABLE", False, "The target broker is not available."),
    ErrorCode(9, "REPLICA_NOT_AVAILABLE", True, "A replica of the partition is not available on this broker."),
    ErrorCode(10, "MESSAGE_TOO_LARGE", False, "A record is larger than the maximum message size the broker accepts."),
    ErrorCode(11, "STALE_CONTROLLER_EPOCH", False, "The request carried an outdated controller epoch; control has moved to another controller."),
    ErrorCode(12, "OFFSET_METADATA_TOO_LARGE", False, "The metadata string attached to an offset commit is too long."),
    ErrorCode(13, "NETWORK_EXCEPTION", True, "The connection was lost before a response arrived."),
    ErrorCode(14, "COORDINATOR_LOAD_IN_PROGRESS", True, "The coordinator is still loading its state and cannot serve the request yet."),
    ErrorCode(15, "COORDINATOR_NOT_AVAILABLE", True, "No coordinator is currently available for the group or transaction."),
    ErrorCode(16, "NOT_COORDINATOR", True, "This broker is not the coordinator for the group or transactional id."),
    ErrorCode(17, "INVALID_TOPIC_EXCEPTION", False, "The topic name is invalid, or the operation is not allowed on that topic."),
    ErrorCode(18, "RECORD_LIST_TOO_LARGE", False, "A record batch is larger than the log segment size configured on the broker."),
    ErrorCode(19, "NOT_ENOUGH_REPLICAS", True, "The write was refused because fewer replicas are in sync than the topic requires."),
    ErrorCode(20, "NOT_ENOUGH_REPLICAS_AFTER_APPEND", True, "The write was appended, but fewer in-sync replicas than required acknowledged it."),
    ErrorCode(21, "INVALID_REQUIRED_ACKS", False, "The produce request's acks value is not allowed."),
    ErrorCode(22, "ILLEGAL_GENERATION", False, "The group generation id in the request is not the current one."),
    ErrorCode(23, "INCONSISTENT_GROUP_PROTOCOL", False, "The member's protocols do not match the group's, or its protocol type or list is empty."),
    ErrorCode(24, "INVALID_GROUP_ID", False, "The group id is empty or otherwise not valid."),
    ErrorCode(25, "UNKNOWN_MEMBER_ID", False, "The coordinator does not know this member id."),
    ErrorCode(26, "INVALID_SESSION_TIMEOUT", False, "The session timeout is outside the range the broker allows for groups."),
    ErrorCode(27, "REBALANCE_IN_PROGRESS", False, "The group is rebalancing; the member has to rejoin."),
    ErrorCode(28, "INVALID_COMMIT_OFFSET_SIZE", False, "The offset commit's data has an invalid size."),
    ErrorCode(29, "TOPIC_AUTHORIZATION_FAILED", False, "The principal is not authorized for the topic."),
    ErrorCode(30, "GROUP_AUTHORIZATION_FAILED", False, "The principal is not authorized for the group."),
    ErrorCode(31, "CLUSTER_AUTHORIZATION_FAILED", False, "The principal is not authorized for the cluster-level operation."),
    ErrorCode(32, "INVALID_TIMESTAMP", False, "A record timestamp is outside the range the broker accepts."),
    ErrorCode(33, "UNSUPPORTED_SASL_MECHANISM", False, "The broker does not offer the requested SASL mechanism."),
    ErrorCode(34, "ILLEGAL_SASL_STATE", False, "The request is not allowed in the connection's current SASL state."),
    ErrorCode(35, "UNSUPPORTED_VERSION", False, "The broker does not support this version of the API."),
    ErrorCode(36, "TOPIC_ALREADY_EXISTS", False, "A topic with this name already exists."),
    ErrorCode(37, "INVALID_PARTITIONS", False, "The requested number of partitions is not valid."),
    ErrorCode(38, "INVALID_REPLICATION_FACTOR", False, "The replication factor is below 1 or above the number of available brokers."),
    ErrorCode(39, "INVALID_REPLICA_ASSIGNMENT", False, "The explicit replica assignment is not valid."),
    ErrorCode(40, "INVALID_CONFIG", False, "A configuration value in the request is not valid."),
    ErrorCode(41, "NOT_CONTROLLER", True, "This node is not the active controller."),
    ErrorCode(42, "INVALID_REQUEST", False, "The request is malformed or not valid for this broker, usually a client bug or a version mismatch."),
    ErrorCode(43, "UNSUPPORTED_FOR_MESSAGE_FORMAT", False, "The topic's message format version cannot support the request."),
    ErrorCode(44, "POLICY_VIOLATION", False, "The request breaks a policy configured on the broker."),
    ErrorCode(45, "OUT_OF_ORDER_SEQUENCE_NUMBER", False, "An idempotent producer sent a sequence number out of order."),
    ErrorCode(46, "DUPLICATE_SEQUENCE_NUMBER", False, "An idempotent producer sent a sequence number the broker has already written."),
    ErrorCode(47, "INVALID_PRODUCER_EPOCH", False, "The producer used an epoch older than the current one."),
    ErrorCode(48, "INVALID_TXN_STATE", False, "The transactional operation is not allowed in the transaction's current state."),
    ErrorCode(49, "INVALID_PRODUCER_ID_MAPPING", False, "The producer id is not the one currently assigned to the transactional id."),
    ErrorCode(50, "INVALID_TRANSACTION_TIMEOUT", False, "The transaction timeout exceeds the broker's maximum (transaction.max.timeout.ms)."),
    ErrorCode(51, "CONCURRENT_TRANSACTIONS", True, "Another operation on the same transaction is still in progress."),
    ErrorCode(52, "TRANSACTION_COORDINATOR_FENCED", False, "The transaction coordinator sending a marker is no longer the current one for the producer."),
    ErrorCode(53, "TRANSACTIONAL_ID_AUTHORIZATION_FAILED", False, "The principal is not authorized for the transactional id."),
    ErrorCode(54, "SECURITY_DISABLED", False, "Security features are not enabled on the broker."),
    ErrorCode(55, "OPERATION_NOT_ATTEMPTED", False, "The broker skipped this operation because others in the same batched request failed."),
    ErrorCode(56, "KAFKA_STORAGE_ERROR", True, "The broker hit a disk error while accessing the log."),
    ErrorCode(57, "LOG_DIR_NOT_FOUND", False, "The requested log directory is not configured on the broker."),
    ErrorCode(58, "SASL_AUTHENTICATION_FAILED", False, "SASL authentication did not succeed."),
    ErrorCode(59, "UNKNOWN_PRODUCER_ID", False, "The broker holds no state for the producer id, e.g. after retention removed all its records."),
    ErrorCode(60, "REASSIGNMENT_IN_PROGRESS", False, "A partition reassignment is already in progress."),
    ErrorCode(61, "DELEGATION_TOKEN_AUTH_DISABLED", False, "Delegation tokens are not enabled."),
    ErrorCode(62, "DELEGATION_TOKEN_NOT_FOUND", False, "The broker has no such delegation token."),
    ErrorCode(63, "DELEGATION_TOKEN_OWNER_MISMATCH", False, "The principal is neither the token's owner nor one of its renewers."),
    ErrorCode(64, "DELEGATION_TOKEN_REQUEST_NOT_ALLOWED", False, "Delegation token requests are refused on plaintext, one-way TLS and token-authenticated connections."),
    ErrorCode(65, "DELEGATION_TOKEN_AUTHORIZATION_FAILED", False, "The principal is not authorized for the delegation token operation."),
    ErrorCode(66, "DELEGATION_TOKEN_EXPIRED", False, "The delegation token has expired."),
    ErrorCode(67, "INVALID_PRINCIPAL_TYPE", False, "The principal type is not supported."),
    ErrorCode(68, "NON_EMPTY_GROUP", False, "The operation needs an empty group, but the group still has members."),
    ErrorCode(69, "GROUP_ID_NOT_FOUND", False, "No group with this id exists."),
    ErrorCode(70, "FETCH_SESSION_ID_NOT_FOUND", True, "The broker does not know the incremental fetch session id."),
    ErrorCode(71, "INVALID_FETCH_SESSION_EPOCH", True, "The fetch session epoch does not match the broker's."),
    ErrorCode(72, "LISTENER_NOT_FOUND", True, "The leader has no listener matching the one the metadata request arrived on."),
    ErrorCode(73, "TOPIC_DELETION_DISABLED", False, "Topic deletion is turned off on the cluster."),
    ErrorCode(74, "FENCED_LEADER_EPOCH", True, "The leader epoch in the request is older than the broker's."),
    ErrorCode(75, "UNKNOWN_LEADER_EPOCH", True, "The leader epoch in the request is newer than any the broker knows."),
    ErrorCode(76, "UNSUPPORTED_COMPRESSION_TYPE", False, "The client cannot handle the partition's compression type."),
    ErrorCode(77, "STALE_BROKER_EPOCH", False, "The broker epoch in the request is out of date."),
    ErrorCode(78, "OFFSET_NOT_AVAILABLE", True, "A new leader's high watermark has not caught up yet, so the offset cannot be served."),
    ErrorCode(79, "MEMBER_ID_REQUIRED", False, "The member must rejoin using the member id the coordinator just assigned."),
    ErrorCode(80, "PREFERRED_LEADER_NOT_AVAILABLE", True, "The preferred replica could not be made leader."),
    ErrorCode(81, "GROUP_MAX_SIZE_REACHED", False, "The group already has the maximum number of members."),
    ErrorCode(82, "FENCED_INSTANCE_ID", False, "Another member registered with the same group.instance.id has replaced this static member."),
    ErrorCode(83, "ELIGIBLE_LEADERS_NOT_AVAILABLE", True, "No replica eligible to lead the partition is available."),
    ErrorCode(84, "ELECTION_NOT_NEEDED", True, "The partition already has the leader the election would choose."),
    ErrorCode(85, "NO_REASSIGNMENT_IN_PROGRESS", False, "There is no partition reassignment in progress."),
    ErrorCode(86, "GROUP_SUBSCRIBED_TO_TOPIC", False, "Offsets cannot be deleted for a topic the group is still subscribed to."),
    ErrorCode(87, "INVALID_RECORD", False, "The broker rejected a record that failed its validation."),
    ErrorCode(88, "UNSTABLE_OFFSET_COMMIT", True, "Pending transactional offset commits must settle before offsets can be read."),
    ErrorCode(89, "THROTTLING_QUOTA_EXCEEDED", True, "The request would exceed the principal's controller mutation quota."),
    ErrorCode(90, "PRODUCER_FENCED", False, "A newer producer with the same transactional id has fenced this one."),
    ErrorCode(91, "RESOURCE_NOT_FOUND", False, "The request refers to a resource that does not exist."),
    ErrorCode(92, "DUPLICATE_RESOURCE", False, "The request names the same resource more than once."),
    ErrorCode(93, "UNACCEPTABLE_CREDENTIAL", False, "The proposed credential does not meet the broker's requirements."),
    ErrorCode(94, "INCONSISTENT_VOTER_SET", False, "The sender or receiver of a KRaft voter-only request is not among the expected voters."),
    ErrorCode(95, "INVALID_UPDATE_VERSION", False, "The update version in the request is not valid."),
    ErrorCode(96, "FEATURE_UPDATE_FAILED", False, "The finalized feature levels could not be updated because of a server error."),
    ErrorCode(97, "PRINCIPAL_DESERIALIZATION_FAILURE", False, "A forwarded request's principal could not be deserialized; the cluster's security setup is at fault."),
    ErrorCode(98, "SNAPSHOT_NOT_FOUND", False, "The requested KRaft snapshot does not exist."),
    ErrorCode(99, "POSITION_OUT_OF_RANGE", False, "The requested snapshot position is negative or beyond the snapshot's size."),
    ErrorCode(100, "UNKNOWN_TOPIC_ID", True, "The broker does not host a topic with this id."),
    ErrorCode(101, "DUPLICATE_BROKER_REGISTRATION", False, "Another broker is already registered with this id."),
    ErrorCode(102, "BROKER_ID_NOT_REGISTERED", False, "No broker is registered with this id."),
    ErrorCode(103, "INCONSISTENT_TOPIC_ID", True, "The topic id in the request differs from the one recorded in the log."),
    ErrorCode(104, "INCONSISTENT_CLUSTER_ID", False, "The cluster id in the request differs from the server's."),
    ErrorCode(105, "TRANSACTIONAL_ID_NOT_FOUND", False, "No transaction state exists for this transactional id."),
    ErrorCode(106, "FETCH_SESSION_TOPIC_ID_ERROR", True, "The fetch session saw inconsistent use of topic ids."),
    ErrorCode(107, "INELIGIBLE_REPLICA", False, "The proposed ISR includes a replica that is not allowed to join it."),
    ErrorCode(108, "NEW_LEADER_ELECTED", False, "The AlterPartition change was applied, but leadership has since moved."),
    ErrorCode(109, "OFFSET_MOVED_TO_TIERED_STORAGE", False, "The requested offset is now held only in tiered (remote) storage."),
    ErrorCode(110, "FENCED_MEMBER_EPOCH", False, "The coordinator fenced the member's epoch; it must give up its partitions and rejoin."),
    ErrorCode(111, "UNRELEASED_INSTANCE_ID", False, "The static instance id is still held by another member, which must leave first."),
    ErrorCode(112, "UNSUPPORTED_ASSIGNOR", False, "The group does not support the requested assignor or its version range."),
    ErrorCode(113, "STALE_MEMBER_EPOCH", False, "The member epoch is out of date; retry once a heartbeat has delivered the current one."),
    ErrorCode(114, "MISMATCHED_ENDPOINT_TYPE", False, "The request reached the wrong kind of endpoint (broker versus controller)."),
    ErrorCode(115, "UNSUPPORTED_ENDPOINT_TYPE", False, "The endpoint type is not supported yet."),
    ErrorCode(116, "UNKNOWN_CONTROLLER_ID", False, "The controller id is not known."),
    ErrorCode(117, "UNKNOWN_SUBSCRIPTION_ID", False, "The client telemetry subscription id is unknown or outdated."),
    ErrorCode(118, "TELEMETRY_TOO_LARGE", False, "The pushed client telemetry is larger than the broker accepts."),
    ErrorCode(119, "INVALID_REGISTRATION", False, "The controller considers the broker's registration invalid."),
    ErrorCode(120, "TRANSACTION_ABORTABLE", False, "The transaction hit an error; aborting it lets the transactional id be used again."),
    ErrorCode(121, "INVALID_RECORD_STATE", False, "The share-group record is not in a state that allows this acknowledgement."),
    ErrorCode(122, "SHARE_SESSION_NOT_FOUND", True, "The broker does not know the share session."),
    ErrorCode(123, "INVALID_SHARE_SESSION_EPOCH", True, "The share session epoch does not match the broker's."),
    ErrorCode(124, "FENCED_STATE_EPOCH", False, "The share coordinator refused the request because the share-group state epoch differs."),
    ErrorCode(125, "INVALID_VOTER_KEY", False, "The voter key does not match the receiving replica's key."),
    ErrorCode(126, "DUPLICATE_VOTER", False, "The voter is already in the voter set."),
    ErrorCode(127, "VOTER_NOT_FOUND", False, "The voter is not in the voter set."),
    ErrorCode(128, "INVALID_REGULAR_EXPRESSION", False, "A regular expression in the request is not valid."),
    ErrorCode(129, "REBOOTSTRAP_REQUIRED", False, "The client's metadata is stale; it should bootstrap again."),
    ErrorCode(130, "STREAMS_INVALID_TOPOLOGY", False, "The Streams group topology supplied is invalid."),
    ErrorCode(131, "STREAMS_INVALID_TOPOLOGY_EPOCH", False, "The Streams topology epoch supplied is invalid."),
    ErrorCode(132, "STREAMS_TOPOLOGY_FENCED", False, "The Streams topology epoch supplied is older than the group's."),
    ErrorCode(133, "SHARE_SESSION_LIMIT_REACHED", True, "The broker already holds as many share sessions as it allows."),
)
# fmt: on

ERROR_CODES: Final[Mapping[int, ErrorCode]] = types.MappingProxyType({e.code: e for e in _TABLE})
"""Every Kafka error code, by number. Read-only."""

ERROR_CODES_BY_NAME: Final[Mapping[str, ErrorCode]] = types.MappingProxyType({e.name: e for e in _TABLE})
"""Every Kafka error code, by Kafka's name (for configuration such as ``reject_with: POLICY_VIOLATION``)."""


def error_name(code: int) -> str:
    """Kafka's name for ``code``, or ``UNKNOWN_ERROR_<code>`` for a code this table does not define."""
    entry = ERROR_CODES.get(code)
    return entry.name if entry is not None else f"UNKNOWN_ERROR_{code}"


def is_retriable(code: int) -> bool:
    """Whether Kafka clients retry on ``code``. Unknown codes are not: Kafka reads them as UNKNOWN_SERVER_ERROR."""
    entry = ERROR_CODES.get(code)
    return entry is not None and entry.retriable


# The codes kproxy itself answers with (policy, quota, decode failures, broker loss). Each must
# equal ERROR_CODES_BY_NAME[<its name>].code; tests/unit/test_errors.py checks that.
UNKNOWN_SERVER_ERROR: Final = -1
NONE: Final = 0
OFFSET_OUT_OF_RANGE: Final = 1
CORRUPT_MESSAGE: Final = 2
UNKNOWN_TOPIC_OR_PARTITION: Final = 3
LEADER_NOT_AVAILABLE: Final = 5
NOT_LEADER_OR_FOLLOWER: Final = 6
REQUEST_TIMED_OUT: Final = 7
BROKER_NOT_AVAILABLE: Final = 8
MESSAGE_TOO_LARGE: Final = 10
NETWORK_EXCEPTION: Final = 13
COORDINATOR_LOAD_IN_PROGRESS: Final = 14
COORDINATOR_NOT_AVAILABLE: Final = 15
NOT_COORDINATOR: Final = 16
INVALID_TOPIC_EXCEPTION: Final = 17
RECORD_LIST_TOO_LARGE: Final = 18
INVALID_REQUIRED_ACKS: Final = 21
TOPIC_AUTHORIZATION_FAILED: Final = 29
GROUP_AUTHORIZATION_FAILED: Final = 30
CLUSTER_AUTHORIZATION_FAILED: Final = 31
INVALID_TIMESTAMP: Final = 32
UNSUPPORTED_SASL_MECHANISM: Final = 33
ILLEGAL_SASL_STATE: Final = 34
UNSUPPORTED_VERSION: Final = 35
INVALID_PARTITIONS: Final = 37
INVALID_REPLICATION_FACTOR: Final = 38
INVALID_CONFIG: Final = 40
NOT_CONTROLLER: Final = 41
INVALID_REQUEST: Final = 42
POLICY_VIOLATION: Final = 44
KAFKA_STORAGE_ERROR: Final = 56
TRANSACTIONAL_ID_AUTHORIZATION_FAILED: Final = 53
SASL_AUTHENTICATION_FAILED: Final = 58
DELEGATION_TOKEN_AUTHORIZATION_FAILED: Final = 65
UNSUPPORTED_COMPRESSION_TYPE: Final = 76
INVALID_RECORD: Final = 87
THROTTLING_QUOTA_EXCEEDED: Final = 89
UNKNOWN_TOPIC_ID: Final = 100
TELEMETRY_TOO_LARGE: Final = 118
