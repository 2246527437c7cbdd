"""kproxy attacked as a hostile client would, on loopback: a forged SASL identity, size prefixes that
claim more than is sent, slow senders, log injection, an exhausted buffer budget, and mutated frames.
Each test asserts what an attacker gets (nothing) and what everyone else keeps (service)."""

from __future__ import annotations

import contextlib
import random
import re
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.protocol.messages import Request, body_class, encode_request_frame
from kproxy.proxy.filters import ALL, ConnectionContext, Filter
from kproxy.server.embedded import ProxyThread
from tests.e2e.mutation import mutate, request_corpus
from tests.e2e.proxied import free_port_block, start_proxy
from tests.e2e.sasl_gate import SaslGate, confluent_roundtrip, expected_pairs
from tests.e2e.tansu import Tansu, TansuBroker, unique_name
from tests.e2e.test_tls import Pki, kproxy_config, pki, server_tls  # noqa: F401 (pki is a fixture)
from tests.e2e.wire import Wire
from tests.polling import wait_until

pytestmark = pytest.mark.e2e

METADATA, SASL_HANDSHAKE, API_VERSIONS, SASL_AUTHENTICATE = 3, 17, 18, 36


class Identities(Filter):
    """What a policy filter would see: (api key, principal, authenticated) per request, and at close."""

    name = "identities"
    request_api_keys = ALL

    def __init__(self) -> None:
        self.seen: list[tuple[int, str | None, bool]] = []
        self.at_close: list[str | None] = []
        self._lock = threading.Lock()

    def on_request(self, ctx: ConnectionContext, exchange) -> None:
        request = exchange.request
        with self._lock:
            self.seen.append((request.api_key, ctx.principal, ctx.authenticated))

    def on_close(self, ctx: ConnectionContext) -> None:
        with self._lock:
            self.at_close.append(ctx.principal)

    def metadata_identities(self) -> list[tuple[str | None, bool]]:
        with self._lock:
            return [(p, a) for k, p, a in self.seen if k == METADATA]


def frame(api_key: int, version: int, correlation_id: int, body: object, client_id: str = "attacker") -> bytes:
    return b"".join(bytes(b) for b in encode_request_frame(
        Request.build(api_key, version, correlation_id, client_id, body)))


def forged_login_steps(user: str = "admin", password: str = "wrong-password") -> list[bytes]:
    """SaslHandshake(PLAIN), SaslAuthenticate with a claimed user, then a Metadata."""
    return [frame(SASL_HANDSHAKE, 1, 1, body_class(SASL_HANDSHAKE, "request")(mechanism="PLAIN")),
            frame(SASL_AUTHENTICATE, 2, 2, body_class(SASL_AUTHENTICATE, "request")(
                auth_bytes=f"\0{user}\0{password}".encode())),
            frame(METADATA, 12, 3, body_class(METADATA, "request")(topics=[]))]


def forged_login(user: str = "admin", password: str = "wrong-password") -> bytes:
    """The three frames of ``forged_login_steps`` back to back, without waiting for answers."""
    return b"".join(forged_login_steps(user, password))


# -- 1. a forged principal


@contextlib.contextmanager
def proxy_behind_sasl_gate(tansu_binary: str, users: dict[str, str], ids: Identities, *,
                           session_lifetime_ms: int = 0) -> Iterator[ProxyThread]:
    """kproxy in front of a SASL-enforcing gate in front of tansu."""
    gate = SaslGate(None, users, session_lifetime_ms=session_lifetime_ms)
    with Tansu(tansu_binary, advertised=gate.address) as tansu:
        gate.upstream = (tansu.host, tansu.port)
        with gate:
            p = start_proxy(gate.bootstrap, advertised_host="127.0.0.1", filters=[ids])
            try:
                yield p
            finally:
                p.stop()


def test_a_forged_sasl_user_is_never_a_principal_behind_a_sasl_broker(tansu_binary: str) -> None:
    ids = Identities()
    with proxy_behind_sasl_gate(tansu_binary, {"admin": "the-real-password", "alice": "pw"}, ids) as p:
        w = Wire(p.bootstrap)
        w.send_raw(forged_login())
        assert w.read_frame() is not None       # the handshake's answer
        w.read_frame()                          # the refusal (the broker then closes)
        wait_until(lambda: ids.metadata_identities())
        assert ids.metadata_identities() == [(None, False)]
        w.close()
        # A real login still works, and only then is there a principal.
        assert confluent_roundtrip({"bootstrap.servers": p.bootstrap, "security.protocol": "SASL_PLAINTEXT",
                                    "sasl.mechanism": "PLAIN", "sasl.username": "alice",
                                    "sasl.password": "pw"}, unique_name("forged")) == expected_pairs()
        assert ("User:alice", True) in ids.metadata_identities()
        assert ("User:admin", True) not in ids.metadata_identities()


def test_a_forged_sasl_user_is_never_a_principal_behind_a_broker_without_sasl(broker: TansuBroker) -> None:
    ids = Identities()
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", filters=[ids])
    try:
        w = Wire(p.bootstrap)
        w.send_raw(forged_login())
        for _ in range(3):                              # tansu refuses both SASL steps, answers Metadata
            assert w.read_frame() is not None
        assert w.metadata(4).correlation_id == 4        # the identity does not stick later either
        assert ids.metadata_identities() == [(None, False), (None, False)]
        w.close()
    finally:
        p.stop()


def test_mtls_plus_a_forged_sasl_user_keeps_the_certificate_identity(broker: TansuBroker, pki: Pki) -> None:  # noqa: F811
    ids = Identities()
    cfg = kproxy_config(broker.bootstrap, server_tls(pki, mtls=True))
    with ProxyThread(cfg, [ids]) as proxy:
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        host, port = proxy.bootstrap.rsplit(":", 1)
        with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10),
                             server_hostname="localhost") as tls:
            tls.sendall(forged_login())
            wait_until(lambda: ids.metadata_identities())
    assert ids.metadata_identities() == [(f"User:{pki.client_subject}", False)]


def test_failed_reauthentication_clears_the_identity(tansu_binary: str) -> None:
    ids = Identities()
    # A session that ends: Kafka's broker re-authenticates only such a one (a session with no end
    # gets ILLEGAL_SASL_STATE and no exchange, KafkaChannel.maybeBeginServerReauthentication).
    with proxy_behind_sasl_gate(tansu_binary, {"alice": "pw"}, ids, session_lifetime_ms=60_000) as p:
        w = Wire(p.bootstrap)
        for step in forged_login_steps("alice", "pw"):    # one at a time: a real login
            w.send_raw(step)
            assert w.read_frame() is not None
        assert ids.metadata_identities() == [("User:alice", True)]
        # KIP-368: authenticate again on the same connection, claiming another user.
        w.send_raw(forged_login("admin", "wrong"))
        wait_until(lambda: len(ids.metadata_identities()) == 2)
        # Pipelined behind the unanswered re-authentication: judged with the identity before it
        # (or none, if the broker's refusal of the handshake got there first), never the claim.
        assert ids.metadata_identities()[1] in (("User:alice", True), (None, False))
        assert w.read_frame() is not None           # handshake
        assert w.read_frame() is not None           # the refusal
        assert w.closed_by_peer()                   # the broker closes after a failure
        w.close()
        wait_until(lambda: ids.at_close)
        assert ids.at_close == [None]               # the refusal cleared the identity


# -- 2. four bytes must not buy 64 MiB, and 3. idle connections cost little


def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


@contextlib.contextmanager
def kproxy_process(tmp_path: Path, upstream: str, *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    port = free_port_block()
    log = tmp_path / "kproxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--upstream", upstream,
                                 "--listen", f"127.0.0.1:{port}", *extra], stdout=subprocess.DEVNULL, stderr=out,
                                start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                Wire(address).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.1)
        yield proc, address, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def warmed_up(proc: subprocess.Popen[bytes], address: str) -> tuple[Wire, int]:
    """A connection that has done one request (so code paths are loaded), and the RSS after it."""
    w = Wire(address)
    assert w.metadata(1).correlation_id == 1
    time.sleep(0.2)
    return w, rss_bytes(proc.pid)


def test_size_prefixes_that_claim_64_mib_cost_what_was_sent(broker: TansuBroker, tmp_path: Path) -> None:
    with kproxy_process(tmp_path, broker.bootstrap) as (proc, address, _log):
        w, before = warmed_up(proc, address)
        attackers = []
        for i in range(20):
            a = Wire(address)
            if i % 2:                                   # half of them after one valid request
                assert a.metadata(1).correlation_id == 1
            a.send_raw(struct.pack(">i", 60 * 1024 * 1024) + b"\x00" * 1000)
            attackers.append(a)
        time.sleep(0.5)
        grown = rss_bytes(proc.pid) - before
        # 20 x 60 MiB were claimed; what arrived is 20 KB. Allow for allocator slack, not for claims.
        assert grown < 30 * 1024 * 1024, f"RSS grew by {grown / 2**20:.1f} MiB"
        assert w.metadata(2).correlation_id == 2
        for a in attackers:
            a.close()
        w.close()


def test_hundreds_of_idle_connections_cost_a_few_kib_each(broker: TansuBroker, tmp_path: Path) -> None:
    with kproxy_process(tmp_path, broker.bootstrap) as (proc, address, _log):
        w, before = warmed_up(proc, address)
        conns = [Wire(address) for _ in range(300)]
        for c in conns[::2]:                            # half of them after one ApiVersions
            c.send(API_VERSIONS, 3, 1, body_class(API_VERSIONS, "request")(
                client_software_name="idle", client_software_version="1"))
            assert c.read_frame() is not None
        time.sleep(0.5)
        per_connection = (rss_bytes(proc.pid) - before) / len(conns)
        # The goal is 1,000 idle connections in 100 MB (bench/idle.py measures that); with a receive
        # chunk of 256 KiB each, as before, this would be over 250 KiB.
        assert per_connection < 60 * 1024, f"{per_connection / 1024:.1f} KiB per idle connection"
        for c in conns:
            c.close()
        w.close()


# -- 4. slow senders


def test_a_slow_sender_is_cut_off_by_the_frame_timeout(broker: TansuBroker) -> None:
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1",
                    limits={"frame_timeout_s": 1.0, "idle_timeout_s": 30})
    try:
        w = Wire(p.bootstrap)
        assert w.metadata(1).correlation_id == 1
        request = frame(METADATA, 12, 2, body_class(METADATA, "request")(topics=[]))
        started = time.monotonic()
        closed = False
        for byte in request[:-1]:                       # one byte every 0.3 s: never a whole frame
            try:
                w.sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.3)
            if time.monotonic() - started > 6:
                break
        assert closed or w.closed_by_peer()
        assert time.monotonic() - started < 4
        w.close()
    finally:
        p.stop()


# -- 5. client strings in the log


def test_client_strings_cannot_forge_log_lines(broker: TansuBroker, tmp_path: Path) -> None:
    with kproxy_process(tmp_path, broker.bootstrap, "--log-level", "DEBUG") as (_proc, address, log):
        w = Wire(address)
        evil = "app\n2026-01-01 00:00:00,000 INFO kproxy.server: FORGED\x1b[31m\x00"
        w.send_raw(frame(METADATA, 12, 1, body_class(METADATA, "request")(topics=[]), client_id=evil)
                   + frame(SASL_HANDSHAKE, 1, 2, body_class(SASL_HANDSHAKE, "request")(
                       mechanism="PLAIN\nFORGED mechanism line"), client_id=evil))
        assert w.read_frame() is not None
        w.close()
        wait_until(lambda: "(client id app" in log.read_text(), what=log.read_text)
        text = log.read_text()
    assert not any(line.startswith(("2026-01-01", "FORGED")) for line in text.splitlines())
    assert "\x1b" not in text and "\x00" not in text
    assert "app\\n2026-01-01" in text                   # the id is there, escaped


# -- the process-wide buffer budget


def test_an_exhausted_buffer_budget_pauses_reads_instead_of_allocating(broker: TansuBroker,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="kproxy")
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1",
                    limits={"max_buffered_bytes_total": 512 * 1024})
    try:
        hog = Wire(p.bootstrap)
        hog.send_raw(struct.pack(">i", 4 * 1024 * 1024) + b"\x00" * 600_000)   # an incomplete big frame
        wait_until(lambda: p.call(lambda: p.server.budget.exhausted))
        other = Wire(p.bootstrap, timeout=20)
        result: list[float] = []

        def ask() -> None:
            started = time.monotonic()
            other.metadata(1)
            result.append(time.monotonic() - started)

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(1.0)
        assert not result                               # not read while the budget is exhausted
        hog.close()                                     # its buffer goes back
        t.join(10)
        assert result and result[0] >= 0.9
        assert any("pausing reads from clients" in r.getMessage() for r in caplog.records)
        # The hog's buffer grew with what it sent (at most twice that), never to the 4 MiB it claimed.
        assert p.call(lambda: p.server.budget.peak) < 2 * 600_000 + 256 * 1024
        other.close()
    finally:
        p.stop()


# -- mutated frames over real sockets


def test_thousands_of_mutated_frames_leave_kproxy_serving(broker: TansuBroker,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="kproxy")
    rng = random.Random(20261123)
    corpus = request_corpus()
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", limits={"frame_timeout_s": 2.0})
    sent = 0
    try:
        while sent < 3000:
            try:
                conn = socket.create_connection(p.bootstrap.rsplit(":", 1), timeout=5)  # type: ignore[arg-type]
            except OSError:
                continue
            conn.settimeout(0.05)
            with conn:
                for _ in range(rng.randint(1, 40)):
                    data = mutate(rng, rng.choice(corpus))
                    try:
                        conn.sendall(struct.pack(">i", len(data)) + data)
                        sent += 1
                        with contextlib.suppress(TimeoutError):
                            conn.recv(65536)
                    except OSError:
                        break                           # closed by kproxy: expected for bad frames
        # Every fault stayed on its connection: no internal error, and a real client works.
        internal = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
        assert internal == []
        assert confluent_roundtrip({"bootstrap.servers": p.bootstrap}, unique_name("after-fuzz")) == expected_pairs()
        held = p.call(lambda: p.server.budget.used)
        assert held < 64 * 1024 * 1024
    finally:
        p.stop()
