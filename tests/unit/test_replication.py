"""MirrorMaker 2's record formats, offset translation and the state file: pure, no broker."""

from __future__ import annotations

import struct

import pytest

from kproxy.replication.mm2 import (
    Checkpoint,
    MM2RecordError,
    OffsetSync,
    OffsetSyncs,
    checkpoints_topic,
    offset_syncs_topic,
    plan_group,
)
from kproxy.replication.state import StateError, VirtualClusterState, choose_active, parse_state, render_state


def test_offset_sync_bytes_are_mm2s() -> None:
    sync = OffsetSync("orders", 3, 1500, 1498)
    # Key: topic as a STRING (int16 length, UTF-8), partition INT32. Value: upstreamOffset, offset (INT64).
    assert sync.key() == b"\x00\x06orders" + b"\x00\x00\x00\x03"
    assert sync.value() == struct.pack(">qq", 1500, 1498)
    assert OffsetSync.decode(sync.key(), sync.value()) == sync


def test_checkpoint_bytes_are_mm2s() -> None:
    cp = Checkpoint("billing", "primary.orders", 0, 1200, 1201, "meta")
    assert cp.key() == b"\x00\x07billing" + b"\x00\x0eprimary.orders" + b"\x00\x00\x00\x00"
    # Value: a version header (INT16 0), upstreamOffset, offset, metadata (STRING).
    assert cp.value() == b"\x00\x00" + struct.pack(">qq", 1200, 1201) + b"\x00\x04meta"
    assert Checkpoint.decode(cp.key(), cp.value()) == cp


def test_mm2s_internal_topic_names() -> None:
    assert offset_syncs_topic("secondary") == "mm2-offset-syncs.secondary.internal"
    assert checkpoints_topic("primary") == "primary.checkpoints.internal"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (None, b"\x00" * 16),
        (b"\x00\x06ord", b"\x00" * 16),                 # the topic runs past the key
        (b"\x00\x01x\x00\x00\x00\x00", b"\x00" * 15),    # a short value
        (b"\xff\xff\x00\x00\x00\x00", b"\x00" * 16),    # a null topic
        (b"\x00\x02\xff\xfe\x00\x00\x00\x00", b"\x00" * 16),    # not UTF-8
    ],
)
def test_a_broken_offset_sync_is_an_error_not_a_crash(key, value) -> None:
    with pytest.raises(MM2RecordError):
        OffsetSync.decode(key, value)


def test_a_checkpoint_of_an_unknown_version_is_refused() -> None:
    cp = Checkpoint("g", "t", 0, 1, 1)
    with pytest.raises(MM2RecordError, match="version 1"):
        Checkpoint.decode(cp.key(), b"\x00\x01" + cp.value()[2:])


def test_translation_is_mm2s_exact_or_one_past_the_sync() -> None:
    syncs = OffsetSyncs()
    syncs.extend([OffsetSync("t", 0, 100, 90), OffsetSync("t", 0, 200, 190), OffsetSync("t", 0, 300, 290)])
    assert syncs.translate("t", 0, 200) == 190        # exactly a synced record
    assert syncs.translate("t", 0, 250) == 191        # between syncs: one past the earlier one, never beyond
    assert syncs.translate("t", 0, 1000) == 291       # past the newest sync
    assert syncs.translate("t", 0, 99) is None        # before every sync: cannot be translated
    assert syncs.translate("t", 1, 200) is None       # another partition
    assert syncs.latest("t", 0) == (300, 290)


def test_a_sync_below_the_newest_means_the_source_started_over() -> None:
    syncs = OffsetSyncs()
    syncs.extend([OffsetSync("t", 0, 500, 500), OffsetSync("t", 0, 10, 700)])
    assert syncs.translate("t", 0, 600) == 701
    assert syncs.translate("t", 0, 5) is None


def test_history_thins_but_stays_bounded_and_monotonic() -> None:
    syncs = OffsetSyncs(per_partition=16)
    for i in range(1, 10_001):
        syncs.add(OffsetSync("t", 0, i * 100, i * 100 - 7))
    ups, _ = syncs._syncs[("t", 0)]
    assert len(ups) <= 16 and ups == sorted(ups)
    assert ups[-1] == 1_000_000         # the newest is always kept exactly
    # Old offsets still translate, conservatively (never beyond the exact answer).
    for upstream in (150, 5_000, 500_000, 999_950):
        got = syncs.translate("t", 0, upstream)
        assert got is not None and got <= upstream - 7 + 1


def test_the_replica_end_that_holds_an_acknowledged_end() -> None:
    syncs = OffsetSyncs()
    assert syncs.replica_end_for("t", 0, 1000) == 1000        # no sync: the same offsets
    syncs.add(OffsetSync("t", 0, 900, 400))
    assert syncs.replica_end_for("t", 0, 1000) == 500         # one to one after the newest sync
    assert syncs.replica_end_for("t", 0, 900) == 401


def test_a_group_resumes_from_the_better_of_kproxys_translation_and_mm2s_checkpoint() -> None:
    syncs = OffsetSyncs()
    syncs.extend([OffsetSync("orders", 0, 1000, 1000), OffsetSync("orders", 1, 500, 500)])
    checkpoints = {("primary.orders", 0): Checkpoint("g", "primary.orders", 0, 700, 700),
                   ("primary.orders", 1): Checkpoint("g", "primary.orders", 1, 900, 900),
                   ("primary.other", 0): Checkpoint("g", "primary.other", 0, 5, 5)}
    # kproxy saw the group commit 1040 (partition 0) and 600 (partition 1) on the primary.
    plan = plan_group({("orders", 0): 1040, ("orders", 1): 600}, syncs, checkpoints, "", "primary.")
    assert plan[("primary.orders", 0)].offset == 1001 and plan[("primary.orders", 0)].source == "kproxy"
    assert plan[("primary.orders", 1)].offset == 900 and plan[("primary.orders", 1)].source == "checkpoint"
    assert plan[("primary.other", 0)].offset == 5


def test_state_round_trip_and_precedence() -> None:
    state = VirtualClusterState("secondary", 2, "primary", "primary", "failover", 1767225600.0, ("primary",))
    text = render_state({"dr-app": state})
    assert parse_state(text) == {"dr-app": state}
    names = ("primary", "secondary")
    assert choose_active("primary", names, state) == (
        "secondary", "the state file (switch 2, failover, from primary)")
    assert choose_active("primary", names, None)[0] == "primary"
    # The configuration changed since that switch: it is the newer decision.
    assert choose_active("secondary", names, VirtualClusterState("primary", 3, "primary"))[0] == "secondary"
    # A cluster no longer configured is not come back to.
    assert choose_active("primary", names, VirtualClusterState("tertiary", 1, "primary"))[0] == "primary"
    assert parse_state("") == {}


@pytest.mark.parametrize("text", ["{", "[]", '{"version": 2, "virtual_clusters": {}}', '{"version": 1}',
                                  '{"version": 1, "virtual_clusters": {"a": {"epoch": 1}}}',
                                  '{"version": 1, "virtual_clusters": {"a": {"active": "p", "epoch": -1}}}'])
def test_a_state_file_that_is_not_kproxys_is_refused(text: str) -> None:
    with pytest.raises(StateError):
        parse_state(text)
