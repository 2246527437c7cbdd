"""What the identity edge adds to a connection's set-up: a PROXY v2 header read before the bytes,
TLS through the reloading context, and an mTLS principal mapped by rules.

One kproxy per configuration in front of one tansu, all started first; then, in interleaved rounds,
each configuration opens connections one after another: TCP connect, the PROXY v2 header (when on),
the TLS handshake (when on), one ApiVersions round trip, close. The table gives the median and p90
set-up time and the ratio of each median to its base (plain, or TLS) in the same run.

``.venv/bin/python bench/edge.py [--connections 200] [--rounds 5]``; ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import socket
import ssl
import statistics
import struct
import tempfile
import time
from pathlib import Path

import trustme

from kproxy.config import parse_config
from kproxy.identity.proxy_header import encode_v2
from kproxy.server.embedded import ProxyThread
from kproxy.tansu import Tansu

# ApiVersions v0, correlation id 1, client id "bench".
_API_VERSIONS = struct.pack(">ihhih", 15, 18, 0, 1, 5) + b"bench"


def _config(broker: str, port: int, tls: str, proxy_protocol: bool) -> object:
    pp = 'proxy_protocol: {mode: optional, trusted: ["127.0.0.0/8"]}\n' if proxy_protocol else ""
    return parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream: {{bootstrap_servers: ["{broker}"]}}
exposure: {{advertised_host: 127.0.0.1, broker_port_start: {port + 1}, broker_port_count: 1}}
log_level: WARNING
{tls}{pp}""")


def _free_port_pair() -> int:
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def _one(port: int, header: bool, tls: ssl.SSLContext | None) -> float:
    start = time.perf_counter()
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if header:
        raw.sendall(encode_v2(("203.0.113.9", 51234), ("127.0.0.1", port)))
    sock: socket.socket = tls.wrap_socket(raw, server_hostname="127.0.0.1") if tls else raw
    with sock:
        sock.sendall(_API_VERSIONS)
        buf = b""
        while len(buf) < 4 or len(buf) < 4 + struct.unpack(">i", buf[:4])[0]:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.connections, args.rounds = 20, 1

    d = Path(tempfile.mkdtemp(prefix="kproxy-bench-edge-"))
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("bench.clients", common_name="bench",
                                                                 organization_unit_name="Bench")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    for name, leaf in (("server", server), ("client", client)):
        leaf.private_key_pem.write_to_path(str(d / f"{name}.key"))
        (d / f"{name}.pem").write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
    tls = f"tls: {{enabled: true, cert_file: {d / 'server.pem'}, key_file: {d / 'server.key'}}}\n"
    mtls = (f"tls: {{enabled: true, cert_file: {d / 'server.pem'}, key_file: {d / 'server.key'}, "
            f"ca_file: {d / 'ca.pem'}, require_client_cert: true, principal: {{mapping_rules: "
            f"['RULE:^CN=([^,]+),OU=Nobody$/$1/', 'RULE:^CN=([^,]+),OU=Bench,.*$/$1/L', DEFAULT]}}}}\n")
    plain_client = None
    tls_client = ssl.create_default_context(cafile=str(d / "ca.pem"))
    mtls_client = ssl.create_default_context(cafile=str(d / "ca.pem"))
    mtls_client.load_cert_chain(str(d / "client.pem"), str(d / "client.key"))
    cases = [  # name, base, tls section, PROXY header, client context
        ("plain", "plain", "", False, plain_client),
        ("plain + PROXY v2", "plain", "", True, plain_client),
        ("TLS", "TLS", tls, False, tls_client),
        ("TLS + PROXY v2", "TLS", tls, True, tls_client),
        ("mTLS + mapping rules", "TLS", mtls, False, mtls_client),
    ]
    with Tansu() as broker:
        proxies = []
        try:
            for _, _, section, header, _ in cases:
                port = _free_port_pair()
                proxies.append((port, ProxyThread(_config(f"{broker.host}:{broker.port}", port, section, header)).start()))
            times: dict[str, list[float]] = {name: [] for name, *_ in cases}
            for _ in range(args.rounds):
                for (name, _, _, header, ctx), (port, _) in zip(cases, proxies, strict=True):
                    _one(port, header, ctx)      # warm-up
                    times[name] += [_one(port, header, ctx) for _ in range(args.connections)]
        finally:
            for _, proxy in proxies:
                proxy.stop()
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"{'connection set-up':<24}{'median ms':>10}{'p90 ms':>9}{'x base':>9}")
    for name, base, *_ in cases:
        t = sorted(times[name])
        p90 = t[int(len(t) * 0.9) - 1]
        print(f"{name:<24}{medians[name] * 1e3:>10.3f}{p90 * 1e3:>9.3f}{medians[name] / medians[base]:>9.2f}")


if __name__ == "__main__":
    main()
