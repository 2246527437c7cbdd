"""The API versions a cluster upgrade removes, for the report's "who breaks" answer; no Spark here.

The facts are each API's lowest version in Apache Kafka 4.0 (KIP-896). The versions below that
come from kproxy's protocol schema, so the table states only what Kafka decided and stays in step
with the versions kproxy can log.
"""

from __future__ import annotations

from kproxy.protocol.messages import api_by_name

REMOVED_IN = "Apache Kafka 4.0 (KIP-896)"

# The lowest request version Apache Kafka 4.0 accepts, for every API whose older versions it
# removed (KIP-896; the 4.0 message definitions mark each as "removed in Apache Kafka 4.0").
# Metadata v0-3 are absent on purpose: KIP-896 listed them, but 4.0 kept them (KAFKA-18648)
# because kafka-python and aiokafka still send Metadata v0.
KAFKA_4_0_MINIMUM_VERSIONS: dict[str, int] = {
    "produce": 3,
    "fetch": 4,
    "list_offsets": 1,
    "offset_commit": 2,
    "offset_fetch": 1,
    "create_topics": 2,
    "delete_topics": 1,
    "offset_for_leader_epoch": 2,
    "write_txn_markers": 1,
    "describe_acls": 1,
    "create_acls": 1,
    "delete_acls": 1,
    "describe_configs": 1,
    "alter_replica_log_dirs": 1,
    "describe_log_dirs": 1,
    "create_delegation_token": 1,
    "renew_delegation_token": 1,
    "expire_delegation_token": 1,
    "describe_delegation_token": 1,
}


def removed_versions() -> list[tuple[str, int, int, int]]:
    """(api, api_key, removed version, minimum kept version) for every version the upgrade removes,
    from the lowest version kproxy's schema knows up to the new minimum."""
    out = []
    for name, minimum in sorted(KAFKA_4_0_MINIMUM_VERSIONS.items()):
        spec = api_by_name(name)  # a KeyError here means the table names an API kproxy lacks
        assert spec.request is not None
        out += [(name, spec.key, v, minimum) for v in range(spec.request.versions.lo, minimum)]
    return out
