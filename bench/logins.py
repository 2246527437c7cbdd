"""What a SASL login to kproxy adds to a connection's set-up: SCRAM-SHA-256/512, PLAIN,
OAUTHBEARER (JWKS cached) and GSSAPI (Kerberos), each against the same connection without a login.

Run from the repository root:  ``.venv/bin/python bench/logins.py [--samples 300]``

One tansu broker and one kproxy process (``sasl`` termination, log level WARNING) are started; a
loopback OIDC provider in this process serves the JWKS and signs the tokens. Each sample opens a
TCP connection, sends ApiVersions and, for a login, SaslHandshake and SaslAuthenticate (twice for
SCRAM) with kproxy's own codec and scramp as the client, and closes it. The client's own work
(SCRAM's PBKDF2 on the client side, signing tokens) happens before the clock starts or is counted
separately, so the figure is kproxy's share. Cases interleave; p50 and p99 per case, and the p50
added over the no-login case.

GSSAPI runs against a throwaway MIT realm (tests/kdc.py: Debian's krb5-kdc on a loopback port).
The client's ticket is got once; each login's tokens are made by python-gssapi in this process
before the clock runs or between the round trips, uncounted (a token may be used only once:
kproxy's replay cache refuses it again), so the figure is kproxy checking the ticket with its
keytab and the three SaslAuthenticate round trips of RFC 4752.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from scramp import ScramClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from proxy import HOST, Child, free_port, free_port_pair

from kproxy.identity.tokens import bearer_message
from kproxy.protocol.messages import Request, body_class, decode_response, encode_request_frame
from kproxy.tansu import Tansu
from kproxy.userfile import add_user
from tests.e2e.oidc import OidcProvider
from tests.kdc import Realm

PASSWORD = "bench-password"
CASES = ("none", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")
SERVICE = "kafka/127.0.0.1"


class Conn:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.cid = 0

    def call(self, api_key: int, version: int, **fields: object) -> object:
        self.cid += 1
        req = Request.build(api_key, version, self.cid, "bench", body_class(api_key, "request")(**fields))
        self.sock.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
        (size,) = struct.unpack(">i", self._read(4))
        return decode_response(self._read(size), api_key, version).body

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("kproxy closed the connection")
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def one(port: int, case: str, token: bytes) -> float:
    """Seconds from connect to a usable (logged-in) connection."""
    scram = ScramClient([case], "bench", PASSWORD) if case.startswith("SCRAM") else None
    kerberos = Kerberos() if case == "GSSAPI" else None     # its first token made before the clock
    t0 = time.perf_counter()
    c = Conn(port)
    try:
        c.call(18, 3, client_software_name="bench", client_software_version="1")
        if case == "none":
            return time.perf_counter() - t0
        hs = c.call(17, 1, mechanism=case)
        assert hs.error_code == 0, hs      # type: ignore[attr-defined]
        if case == "PLAIN":
            auth = c.call(36, 2, auth_bytes=b"\x00bench\x00" + PASSWORD.encode())
        elif case == "OAUTHBEARER":
            auth = c.call(36, 2, auth_bytes=token)
        elif kerberos is not None:
            mutual = c.call(36, 2, auth_bytes=kerberos.token)
            t_client = time.perf_counter()
            reply = kerberos.after_mutual(bytes(mutual.auth_bytes))  # type: ignore[attr-defined]
            t0 += time.perf_counter() - t_client
            offer = c.call(36, 2, auth_bytes=reply)
            t_client = time.perf_counter()
            choice = kerberos.choose(bytes(offer.auth_bytes))  # type: ignore[attr-defined]
            t0 += time.perf_counter() - t_client
            auth = c.call(36, 2, auth_bytes=choice)
        else:
            assert scram is not None
            first = c.call(36, 2, auth_bytes=scram.get_client_first().encode())
            # The client's PBKDF2 (the whole point of SCRAM's iterations) is not kproxy's time.
            t_client = time.perf_counter()
            scram.set_server_first(bytes(first.auth_bytes).decode())  # type: ignore[attr-defined]
            final_msg = scram.get_client_final().encode()
            t0 += time.perf_counter() - t_client
            auth = c.call(36, 2, auth_bytes=final_msg)
        assert auth.error_code == 0, auth  # type: ignore[attr-defined]
        return time.perf_counter() - t0
    finally:
        c.close()


class Kerberos:
    """The client side of one GSSAPI login (RFC 4752), on python-gssapi and the bench user's ticket."""

    def __init__(self) -> None:
        import gssapi

        name = gssapi.Name(f"{SERVICE}@KPROXY.TEST", gssapi.NameType.kerberos_principal)
        self.context = gssapi.SecurityContext(name=name, usage="initiate")
        self.token = self.context.step(None)

    def after_mutual(self, token: bytes) -> bytes:
        return self.context.step(token) or b""

    def choose(self, offer: bytes) -> bytes:
        self.context.unwrap(offer)
        return self.context.wrap(b"\x01\x00\x00\x00", False).message


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=300, help="logins per case (default 300)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kproxy-logins-") as tmp, OidcProvider({"bench": "s"}) as oidc, \
            Realm(Path(tmp) / "realm") as realm, realm.environment(Path(tmp) / "bench-cc"):
        work = Path(tmp)
        realm.add_principal(SERVICE)
        keytab = realm.keytab(work / "kproxy.keytab", SERVICE)
        bench_user = realm.add_principal("bench")
        realm.kinit(bench_user, realm.keytab(work / "bench.keytab", bench_user), work / "bench-cc")
        users = work / "users.yaml"
        add_user(str(users), "bench", PASSWORD)
        launcher = Tansu(port=free_port())
        broker = Child("tansu", launcher.argv(), work / "broker.log")
        broker.start([launcher.port])
        kp = free_port_pair()
        cfg = work / "kproxy.yaml"
        cfg.write_text(f"""\
listen: "{HOST}:{kp}"
upstream: {{bootstrap_servers: "{HOST}:{launcher.port}"}}
log_level: WARNING
sasl:
  mechanisms: [PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER, GSSAPI]
  users_file: {users}
  max_failed_logins_per_minute: 0
  oauth: {{jwks_url: "{oidc.jwks_url}", issuer: "{oidc.issuer}", audience: kafka}}
  gssapi: {{principal: "{realm.principal(SERVICE)}", keytab: "{keytab}"}}
""")
        kproxy = Child("kproxy", [sys.executable, "-m", "kproxy", "run", "--config", str(cfg)], work / "kproxy.log",
                       env={**os.environ, **realm.env(work / "kproxy-cc")})
        try:
            kproxy.start([kp, kp + 1])
            token = bearer_message(oidc.token("bench", lifetime_s=3600))
            samples: dict[str, list[float]] = {c: [] for c in CASES}
            for c in CASES:                      # warm-up: codecs compiled, JWKS fetched
                one(kp, c, token)
            for i in range(args.samples):
                order = CASES[i % len(CASES):] + CASES[: i % len(CASES)]
                for c in order:
                    samples[c].append(one(kp, c, token))
        finally:
            kproxy.stop()
            broker.stop()
    base = statistics.median(samples["none"])
    print(f"{args.samples} connections per case, {os.cpu_count()} CPUs, load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"{'case':<16}{'p50 ms':>9}{'p99 ms':>9}{'added p50 ms':>14}")
    for c in CASES:
        xs = sorted(samples[c])
        p50, p99 = statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.99))]
        added = "-" if c == "none" else f"{(p50 - base) * 1000:.2f}"
        print(f"{c:<16}{p50 * 1000:>9.2f}{p99 * 1000:>9.2f}{added:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
