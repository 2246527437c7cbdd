"""TLS contexts that follow their files, and SNI names, with in-memory handshakes (no sockets):
a change is picked up, a broken change keeps the old context with one ERROR line, and SNI accepts
only the names kproxy serves, recording the one asked on the connection itself."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import pytest
import trustme

from kproxy.config import TlsServerSide
from kproxy.server.tls_files import ReloadingContext
from kproxy.server.transport import SniNames, server_context

DOMAIN = "kafka.example.com"


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str | None) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """Run a TLS handshake between two in-memory ends; raises the side's ssl.SSLError on failure."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    cli = client.wrap_bio(c_in, c_out, server_hostname=name)
    done = {"s": False, "c": False}
    for _ in range(20):
        for key, end in (("c", cli), ("s", srv)):
            if not done[key]:
                try:
                    end.do_handshake()
                    done[key] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return srv, cli
    raise AssertionError("handshake did not finish")


@pytest.fixture
def pki(tmp_path: Path) -> tuple[trustme.CA, Path]:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return ca, tmp_path


def write_leaf(leaf: trustme.LeafCert, d: Path) -> TlsServerSide:
    (d / "tls.crt").write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
    (d / "tls.key").write_bytes(leaf.private_key_pem.bytes())
    return TlsServerSide(enabled=True, cert_file=str(d / "tls.crt"), key_file=str(d / "tls.key"))


def peer_cn(cli: ssl.SSLObject) -> str:
    cert = cli.getpeercert()
    assert cert
    return dict(rdn[0] for rdn in cert["subject"])["commonName"]


def test_reload_swaps_the_context_and_a_broken_file_keeps_the_old(pki: tuple[trustme.CA, Path],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    ca, d = pki
    cfg = write_leaf(ca.issue_cert("kp", common_name="first"), d)
    loads: list[int] = []
    ctx = ReloadingContext("tls", [cfg.cert_file or "", cfg.key_file or ""], lambda: server_context(cfg),
                           server_side=True, on_loaded=lambda: loads.append(1))
    client = ssl.create_default_context(cafile=str(d / "ca.pem"))
    assert peer_cn(handshake(ctx, client, "kp")[1]) == "first"
    assert not ctx.check()                                   # nothing changed
    _, old_cli = handshake(ctx, client, "kp")

    write_leaf(ca.issue_cert("kp", common_name="second"), d)
    assert ctx.check()
    assert peer_cn(handshake(ctx, client, "kp")[1]) == "second"
    assert peer_cn(old_cli) == "first"                       # an open connection keeps its own
    assert loads == [1, 1] and ctx.reloads_ok == 1

    caplog.set_level(logging.INFO, logger="kproxy")
    (d / "tls.key").write_bytes(b"-----BEGIN PRIVATE KEY-----\ntruncated")
    assert not ctx.check()
    assert not ctx.check()                                   # judged once per change
    assert peer_cn(handshake(ctx, client, "kp")[1]) == "second"
    assert ctx.reloads_failed == 1 and loads == [1, 1]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("tls: the certificate files changed but do not load")
    (d / "tls.key").unlink()
    assert not ctx.check() and ctx.reloads_failed == 2
    assert "cannot read" in caplog.records[-1].getMessage()


@pytest.mark.parametrize(("name", "ok"), [
    (f"broker-0.{DOMAIN}", True), (f"broker-2147483647.{DOMAIN}", True), (f"controller-3.{DOMAIN}", True),
    (f"bootstrap.{DOMAIN}", True), (f"BROKER-7.{DOMAIN.upper()}", True),
    (f"broker-01.{DOMAIN}", False), (f"broker-2147483648.{DOMAIN}", False), (f"broker-.{DOMAIN}", False),
    (f"broker--1.{DOMAIN}", False), (f"broker-1x.{DOMAIN}", False), (f"x.broker-1.{DOMAIN}", False),
    (f"junk.{DOMAIN}", False), (f"broker-\u0661.{DOMAIN}", False),
])
def test_sni_accepts_only_served_names(name: str, ok: bool) -> None:
    names = SniNames(DOMAIN)
    assert names.accepts(name.lower()) is ok


def test_sni_name_is_recorded_on_the_connection_and_junk_is_refused(pki: tuple[trustme.CA, Path]) -> None:
    ca, d = pki
    cfg = write_leaf(ca.issue_cert(f"*.{DOMAIN}", "localhost"), d)
    names = SniNames(DOMAIN)
    server = server_context(cfg, names)
    client = ssl.create_default_context(cafile=str(d / "ca.pem"))
    for i in range(1024):
        with pytest.raises(ssl.SSLError):
            handshake(server, client, f"junk-{i}.{DOMAIN}")
    assert names.refused == 1024
    srv, _ = handshake(server, client, f"broker-5.{DOMAIN}")
    assert SniNames.name_of(srv) == f"broker-5.{DOMAIN}"
    srv, _ = handshake(server, client, "localhost")       # outside the domain: the bootstrap
    assert SniNames.name_of(srv) is None
