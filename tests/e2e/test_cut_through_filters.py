"""Cut-through in a real deployment on tansu: with a rules file and quotas in force, and over TLS, a
consumer gets every record back and /metrics says its Fetch answers were streamed. (A Fetch that names a
refused topic next to an allowed one is stored; real clients never send one, since the refused
topic's metadata is refused first: tests/unit/test_cut_through_filters.py covers it.)"""

from __future__ import annotations

import contextlib
import ssl
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
import trustme

from kproxy.config import parse_config
from kproxy.server.embedded import ProxyThread
from tests.e2e.proxied import free_port_block, start_proxy
from tests.e2e.scenarios import _ck_admin, _ck_wait
from tests.e2e.tansu import Tansu, TansuBroker, free_port
from tests.e2e.test_cut_through import (
    SPLICED,
    STREAM_FROM,
    STREAMED,
    consumed_all,
    metrics,
    produce_direct,
    records,
)
from tests.e2e.test_produce_cut_through import STREAMED as PRODUCE_STREAMED
from tests.e2e.test_produce_cut_through import confluent_produce
from tests.e2e.test_produce_cut_through import records as produce_records
from tests.e2e.test_tls import TlsRelay

pytestmark = pytest.mark.e2e

RULES = """\
rules:
  - name: no-secrets
    match: {topic: "secret-*"}
    action: deny
quotas:
  - name: readers
    fetch_bytes_per_s: 1.0e9
    requests_per_s: 10000
"""


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(textwrap.dedent(RULES))
    return path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    leaf.private_key_pem.write_to_path(str(d / "server.key"))
    with open(d / "server.pem", "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    return {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server.key")}


@pytest.fixture(scope="module")
def filled(broker: TansuBroker) -> Iterator[str]:
    """One topic of large records (tansu answers a Fetch of it with about 0.8 MB), made once for the
    module, and deleted afterwards: later tests list every topic."""
    topic = f"stream-rules-{uuid.uuid4().hex[:8]}"
    produce_direct(broker.bootstrap, topic)
    yield topic
    with contextlib.suppress(Exception):
        _ck_wait(_ck_admin(broker.bootstrap).delete_topics([topic], request_timeout=30))


@contextlib.contextmanager
def proxy(broker: TansuBroker, rules: Path, **overrides: Any) -> Iterator[tuple[ProxyThread, str]]:
    admin = f"127.0.0.1:{free_port()}"
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", admin={"listen": admin}, rules=[str(rules)],
                    **{"cut_through_min_bytes": STREAM_FROM, **overrides})
    try:
        yield p, admin
    finally:
        p.stop()


def consume(bootstrap: str, topic: str, n: int, **settings: Any) -> list[tuple[bytes, bytes]]:
    """Partition 0 from the start with confluent-kafka (assigned, no group) until ``n`` records or 30 s."""
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": f"unused-{uuid.uuid4().hex[:8]}",
                                         "enable.auto.commit": False, "auto.offset.reset": "earliest", **settings})
    got: list[tuple[bytes, bytes]] = []
    try:
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            m = consumer.poll(0.2)
            if m is not None and m.error() is None:
                got.append((m.key(), m.value()))
    finally:
        consumer.close()
    return got


def every_record(got: list[tuple[bytes, bytes]]) -> bool:
    return consumed_all([(None, k, v, None) for k, v in got])


@pytest.mark.parametrize("splice", [False, True])
def test_with_rules_and_quotas_a_consumer_gets_every_record_through_streamed_answers(
        broker: TansuBroker, filled: str, rules_file: Path, splice: bool) -> None:
    with proxy(broker, rules_file, cut_through_splice=splice) as (p, admin):
        got = consume(p.bootstrap, filled, len(records()))
        assert every_record(got), f"{len(got)} of {len(records())} records"
        m = metrics(admin)
        assert m.get(STREAMED, 0) > 0, "no answer was streamed"
        assert (m.get(SPLICED, 0) > 0) == splice
        # Nothing large was stored for a filter's sake: the policy and the quota both consented.
        assert not [k for k in m if k[0] == "kproxy_frames_stored_large_total" and k[1][2][1].startswith("filter")], m


def test_over_tls_with_rules_a_consumer_gets_every_record_through_streamed_answers(
        broker: TansuBroker, filled: str, rules_file: Path, certs: dict[str, str]) -> None:
    tls = {"enabled": True, "cert_file": certs["cert"], "key_file": certs["key"]}
    with proxy(broker, rules_file, tls=tls) as (p, admin):
        got = consume(p.bootstrap, filled, len(records()), **{"security.protocol": "SSL",
                                                                 "ssl.ca.location": certs["ca"]})
        assert every_record(got), f"{len(got)} of {len(records())} records"
        assert metrics(admin).get(STREAMED, 0) > 0, "no answer was streamed over TLS"


def test_from_a_tls_broker_with_quotas_a_consumer_gets_every_record_through_streamed_answers(
        tansu_binary: str, certs: dict[str, str], tmp_path: Path) -> None:
    """kproxy originates TLS to the broker (a TLS-terminating relay in front of a tansu that advertises
    the relay, since tansu serves no TLS itself): the answers are decrypted into the reader's chunk and
    streamed from there, and large Produce requests are encrypted piece by piece. Quotas only: a topic
    rule would keep Produce requests whole (docs/performance-streaming.md)."""
    rules_file = tmp_path / "quotas.yaml"
    rules_file.write_text(RULES[RULES.index("quotas:"):])
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs["cert"], certs["key"])
    admin = f"127.0.0.1:{free_port()}"
    with TlsRelay(ctx) as relay, Tansu(tansu_binary, advertised=relay.address, log_path=tmp_path / "b.log") as tansu:
        relay.target = (tansu.host, tansu.port)
        cfg = parse_config(f"""\
listen: "127.0.0.1:{free_port_block()}"
upstream:
  bootstrap_servers: ["{relay.address[0]}:{relay.address[1]}"]
  tls: {{enabled: true, ca_file: "{certs['ca']}"}}
exposure: {{advertised_host: 127.0.0.1, broker_port_count: 6}}
admin: {{listen: "{admin}"}}
rules: ["{rules_file}"]
cut_through_min_bytes: {STREAM_FROM}
""")
        with ProxyThread(cfg) as p:
            topic = f"stream-tls-{uuid.uuid4().hex[:8]}"
            produce_direct(p.bootstrap, topic)       # through kproxy: the broker speaks only TLS
            got = consume(p.bootstrap, topic, len(records()))
            assert every_record(got), f"{len(got)} of {len(records())} records"
            assert metrics(admin).get(STREAMED, 0) > 0, "no answer from the TLS broker was streamed"
            # Large Produce requests stream to the TLS broker too: pieces encrypted as they arrive.
            produced = f"{topic}-produce"
            confluent_produce(p.bootstrap, produced)
            got = consume(p.bootstrap, produced, len(produce_records(produced)))
            assert sorted(got) == produce_records(produced)
            assert metrics(admin).get(PRODUCE_STREAMED, 0) > 0, "no Produce request to the TLS broker was streamed"
