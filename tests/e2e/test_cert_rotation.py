"""Certificates rotated on disk while clients stay connected: kproxy's own certificate (client side)
and the one it presents to brokers (upstream side), laid out as cert-manager and Kubernetes
Secret volumes do (``tls.crt`` -> ``..data/tls.crt``, ``..data`` -> a timestamped directory, one
symlink swapped per update). New handshakes get the new files, open connections keep working, and a
broken update keeps the old certificate with an ERROR line. Also: mapped principals and SPIFFE IDs
from real handshakes, and a PROXY header ahead of a ClientHello.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import ssl
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import trustme

from kproxy.config import parse_config
from kproxy.identity.proxy_header import encode_v2
from kproxy.protocol.messages import Request, body_class, decode_response, encode_request_frame
from kproxy.proxy.filters import ALL, ConnectionContext, Filter
from kproxy.server.embedded import ProxyThread
from tests.e2e.sasl_gate import free_ports
from tests.e2e.tansu import TansuBroker, unique_name
from tests.polling import wait_until

with warnings.catch_warnings():
    # kafka-python 3.0 loads its schemas with the importlib.resources calls deprecated in 3.11.
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka

pytestmark = pytest.mark.e2e

TIMEOUT = 20.0
METADATA = 3


class SecretVolume:
    """A directory laid out like a mounted Kubernetes Secret; ``update`` swaps it atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.generation = 0
        root.mkdir(parents=True, exist_ok=True)

    def update(self, files: dict[str, bytes]) -> None:
        self.generation += 1
        data = self.root / f"..2026_11_25_{self.generation:04d}"
        data.mkdir()
        for name, content in files.items():
            (data / name).write_bytes(content)
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(Path("..data") / name)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(data.name)
        os.replace(tmp, self.root / "..data")    # the one atomic step of an update

    def path(self, name: str) -> str:
        return str(self.root / name)


def leaf_files(leaf: trustme.LeafCert) -> dict[str, bytes]:
    return {"tls.crt": b"".join(blob.bytes() for blob in leaf.cert_chain_pems),
            "tls.key": leaf.private_key_pem.bytes()}


class Principals(Filter):
    name = "principals"
    request_api_keys = ALL

    def __init__(self) -> None:
        self.seen: set[tuple[str | None, str | None]] = set()
        self._lock = threading.Lock()

    def on_request(self, ctx: ConnectionContext, exchange: object) -> None:
        with self._lock:
            self.seen.add((ctx.principal, ctx.client_address[0] if ctx.client_address else None))


def metadata(sock: ssl.SSLSocket, correlation_id: int) -> Any:
    req = Request.build(METADATA, 12, correlation_id, "rotation-probe", body_class(METADATA, "request")(topics=[]))
    sock.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return decode_response(buf[4:], METADATA, 12).body


def connect(ctx: ssl.SSLContext, address: tuple[str, int]) -> ssl.SSLSocket:
    return ctx.wrap_socket(socket.create_connection(address, timeout=TIMEOUT), server_hostname="127.0.0.1")


def serial_of(sock: ssl.SSLSocket) -> int:
    from cryptography import x509

    der = sock.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def serial_of_pem(pem: bytes) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem).serial_number


def test_server_certificate_rotates_under_connected_clients(broker: TansuBroker, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kproxy")
    ca = trustme.CA()
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    old_expiry, new_expiry = now + datetime.timedelta(hours=3), now + datetime.timedelta(days=90)
    old = ca.issue_cert("127.0.0.1", common_name="kproxy-old", not_after=old_expiry)
    new = ca.issue_cert("127.0.0.1", common_name="kproxy-new", not_after=new_expiry)
    volume = SecretVolume(tmp_path / "tls")
    volume.update(leaf_files(old))
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    port, broker_port, admin = free_ports(3)
    cfg = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream: {{bootstrap_servers: ["{broker.bootstrap}"]}}
exposure: {{advertised_host: 127.0.0.1, broker_port_start: {broker_port}, broker_port_count: 1}}
tls: {{enabled: true, cert_file: {volume.path("tls.crt")}, key_file: {volume.path("tls.key")}}}
admin: {{listen: "127.0.0.1:{admin}"}}
""")
    proxy = ProxyThread(cfg)
    proxy.server.tls_poll_interval_s = 0.1
    client_ctx = ssl.create_default_context(cafile=str(ca_file))
    address = ("127.0.0.1", port)
    topic = unique_name("rotation")
    assert proxy.server.metrics is not None

    def expiry() -> str:
        text = proxy.call(proxy.process.shared.certificates.families)
        cert = str(volume.path("tls.crt"))
        return next((str(s.value) for family in text for s in family.samples if s.labels == {"file": cert}), "")

    with proxy, contextlib.ExitStack() as stack:
        assert float(expiry()) == old_expiry.timestamp()
        first = stack.enter_context(connect(client_ctx, address))
        assert serial_of(first) == serial_of_pem(old.cert_chain_pems[0].bytes())
        assert metadata(first, 1).brokers
        # A real client that stays connected across the rotation.
        producer = kafka.KafkaProducer(bootstrap_servers=f"127.0.0.1:{port}", security_protocol="SSL",
                                       ssl_cafile=str(ca_file), acks="all", request_timeout_ms=int(TIMEOUT * 1000))
        stack.callback(producer.close, 5)
        producer.send(topic, b"before").get(timeout=TIMEOUT)
        opened = proxy.call(lambda: proxy.server.stats.connections_total)

        volume.update(leaf_files(new))
        tls = proxy.server.client_tls
        assert tls is not None
        wait_until(lambda: proxy.call(lambda: tls.reloads_ok) == 1, "the reload")

        second = stack.enter_context(connect(client_ctx, address))
        assert serial_of(second) == serial_of_pem(new.cert_chain_pems[0].bytes())
        assert float(expiry()) == new_expiry.timestamp()
        # The connections from before the rotation still work.
        assert metadata(first, 2).brokers
        producer.send(topic, b"after").get(timeout=TIMEOUT)
        assert proxy.call(lambda: proxy.server.stats.connections_total) == opened + 1   # no reconnect

        # A broken update (a third certificate with a key that does not match) keeps the new one in force.
        third = ca.issue_cert("127.0.0.1", common_name="kproxy-third", not_after=now + datetime.timedelta(days=1))
        volume.update({**leaf_files(third), "tls.key": old.private_key_pem.bytes()})
        wait_until(lambda: proxy.call(lambda: tls.reloads_failed) == 1, "the failed reload")
        later = stack.enter_context(connect(client_ctx, address))
        assert serial_of(later) == serial_of_pem(new.cert_chain_pems[0].bytes())
        assert metadata(later, 1).brokers
        assert float(expiry()) == new_expiry.timestamp()      # the refused files never counted
        text = proxy.call(proxy.server.metrics.exposition).decode()
        assert 'kproxy_tls_reloads_total{outcome="ok",setting="tls"} 1.0' in text
        assert 'kproxy_tls_reloads_total{outcome="failed",setting="tls"} 1.0' in text
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "tls: the certificate files changed but do not load" in errors[0].getMessage()
    assert "KEY_VALUES_MISMATCH" in errors[0].getMessage()


def write_svid(ca: trustme.CA, spiffe_id: str, cert_path: Path, key_path: Path) -> None:
    """An X.509-SVID (trustme writes no URI SANs): an empty subject and one URI SAN, signed by ``ca``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe_id)]), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))


def test_mapped_principals_spiffe_ids_and_proxy_header_before_tls(broker: TansuBroker, tmp_path: Path) -> None:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    alice = ca.issue_cert("alice.clients.test", common_name="Alice", organization_unit_name="Payments",
                          organization_name="Acme")
    for name, leaf in (("server", server), ("alice", alice)):
        leaf.private_key_pem.write_to_path(str(tmp_path / f"{name}.key"))
        (tmp_path / f"{name}.pem").write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
    write_svid(ca, "spiffe://example.org/ns/pay/sa/api", tmp_path / "svid.pem", tmp_path / "svid.key")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))

    def run(principal: str, client: str, proxy_header: bool = False) -> set[tuple[str | None, str | None]]:
        port, broker_port = free_ports(2)
        cfg = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream: {{bootstrap_servers: ["{broker.bootstrap}"]}}
exposure: {{advertised_host: 127.0.0.1, broker_port_start: {broker_port}, broker_port_count: 1}}
tls:
  enabled: true
  cert_file: {tmp_path / "server.pem"}
  key_file: {tmp_path / "server.key"}
  ca_file: {tmp_path / "ca.pem"}
  require_client_cert: true
  principal: {principal}
proxy_protocol: {{mode: optional, trusted: ["127.0.0.3/32"]}}
""")
        recorder = Principals()
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        ctx.load_cert_chain(str(tmp_path / f"{client}.pem"), str(tmp_path / f"{client}.key"))
        with ProxyThread(cfg, [recorder]), socket.socket() as raw:
            raw.bind(("127.0.0.3", 0))
            raw.settimeout(TIMEOUT)
            raw.connect(("127.0.0.1", port))
            if proxy_header:
                raw.sendall(encode_v2(("192.0.2.10", 5555), ("127.0.0.1", port)))
            # A refused connection ends at the handshake or the first read.
            with contextlib.suppress(ConnectionError, ssl.SSLError), \
                    ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                metadata(tls, 1)
        return recorder.seen

    rules = '{mapping_rules: ["RULE:^CN=([^,]+),OU=Payments,O=Acme$/$1@payments/L", "DEFAULT"]}'
    assert run(rules, "alice") == {("User:alice@payments", "127.0.0.3")}
    assert run("{san_uri: true}", "svid", proxy_header=True) == {
        ("User:spiffe://example.org/ns/pay/sa/api", "192.0.2.10")}
    # No rule matches: the connection is refused after the handshake, nothing reaches a filter.
    assert run('{mapping_rules: ["RULE:^CN=nobody$/x/"]}', "alice") == set()
    # A certificate without a URI SAN has no SPIFFE ID.
    assert run("{san_uri: true}", "alice") == set()


def test_upstream_client_certificate_rotates(broker: TansuBroker, tmp_path: Path) -> None:
    """kproxy's own certificate towards the brokers follows its files too: the TLS broker (a relay
    that requires and records client certificates) sees the new subject on new connections."""
    from tests.e2e.tansu import Tansu
    from tests.e2e.test_tls import TlsRelay

    ca = trustme.CA()
    relay_leaf = ca.issue_cert("127.0.0.1")
    first, second = (ca.issue_cert("kproxy.test", common_name=cn) for cn in ("kproxy-1", "kproxy-2"))
    relay_leaf.private_key_pem.write_to_path(str(tmp_path / "relay.key"))
    (tmp_path / "relay.pem").write_bytes(b"".join(b.bytes() for b in relay_leaf.cert_chain_pems))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    relay_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tmp_path / "ca.pem"))
    relay_ctx.load_cert_chain(str(tmp_path / "relay.pem"), str(tmp_path / "relay.key"))
    relay_ctx.verify_mode = ssl.CERT_REQUIRED
    volume = SecretVolume(tmp_path / "upstream")
    volume.update(leaf_files(first))
    binary = broker.binary
    with TlsRelay(relay_ctx) as relay, Tansu(binary, advertised=relay.address,
                                             log_path=tmp_path / "tansu.log") as tansu:
        relay.target = (tansu.host, tansu.port)
        port, broker_port = free_ports(2)
        cfg = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream:
  bootstrap_servers: ["{relay.address[0]}:{relay.address[1]}"]
  tls: {{enabled: true, ca_file: {tmp_path / "ca.pem"}, cert_file: {volume.path("tls.crt")},
         key_file: {volume.path("tls.key")}}}
exposure: {{advertised_host: 127.0.0.1, broker_port_start: {broker_port}, broker_port_count: 1}}
""")
        proxy = ProxyThread(cfg)
        proxy.server.tls_poll_interval_s = 0.1
        with proxy:
            wait_until(lambda: bool(relay.peer_subjects), "discovery")
            assert {s.partition(",")[0] for s in relay.peer_subjects} == {"CN=kproxy-1"}
            volume.update(leaf_files(second))
            up = proxy.server.upstream_tls
            assert up is not None
            wait_until(lambda: proxy.call(lambda: up.reloads_ok) == 1, "the upstream reload")
            before = len(relay.peer_subjects)
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
                req = Request.build(18, 0, 1, "probe", body_class(18, "request")())
                s.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
                assert len(s.recv(4096)) > 4
            assert {s.partition(",")[0] for s in relay.peer_subjects[before:]} == {"CN=kproxy-2"}
