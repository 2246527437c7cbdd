"""What a client looping on KIP-368 re-authentication costs kproxy's SASL termination, per loop:
a re-authentication that is begun (PLAIN: one PBKDF2 of 4096 iterations; SCRAM-SHA-256: the
server's proof check) against a SaslHandshake refused because it came within a second of the
previous re-authentication's start, as Kafka's broker refuses it.

Run from the repository root:  ``.venv/bin/python bench/reauth_loop.py [--loops 300] [--rounds 5]``

In-process and sans-I/O (the session and its SASL front, the session clock stepped by hand), so the
figure is CPU per loop (``time.process_time``), which moves little with the machine's load; the
median of the rounds is printed with the spread. Sockets and the event loop add the same to both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from scramp import ScramClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kproxy.identity.termination import SaslTermination, TerminationSettings
from kproxy.identity.users import UserBook, new_credential
from kproxy.protocol.messages import Request, body_class, decode_response, encode_request_frame
from kproxy.proxy.actions import ToClient
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.sasl import SaslFront
from kproxy.proxy.session import Session

SASL_HANDSHAKE, SASL_AUTHENTICATE = 17, 36
USER, PASSWORD = "alice", "bench-pw"
USERS = UserBook({USER: {m: new_credential(m, PASSWORD) for m in ("SCRAM-SHA-256", "SCRAM-SHA-512")}})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def frame(key: int, cid: int, **fields: object) -> memoryview:
    version = 1 if key == SASL_HANDSHAKE else 2
    req = Request.build(key, version, cid, "bench", body_class(key, "request")(**fields))
    return memoryview(b"".join(bytes(b) for b in encode_request_frame(req))[4:])


def connection(mechanism: str) -> tuple[Session, SaslTermination, Clock]:
    clock = Clock()
    ctx = ConnectionContext(1, client_address=("10.1.2.3", 5555), clock=clock)
    t = SaslTermination(TerminationSettings((mechanism,), USERS, max_session_s=3600), clock=clock,
                        wall_clock=time.time)
    return Session(ctx, FilterChain([]), front=SaslFront(ctx, t)), t, clock


def per_loop(mechanism: str, loops: int, step_s: float) -> float:
    """CPU seconds per loop on kproxy's side: a SaslHandshake every ``step_s`` of session clock, then,
    when it was accepted, the login (the client's own SCRAM work is taken out)."""
    s, t, clock = connection(mechanism)
    cid = 0

    def send(key: int, **fields: object) -> bytes:
        nonlocal cid
        cid += 1
        actions = s.client_frame(frame(key, cid, **fields))
        data = b"".join(bytes(b) for a in actions if isinstance(a, ToClient) for b in a.buffers)
        if key != SASL_AUTHENTICATE or not data:
            return b""
        return bytes(decode_response(memoryview(data[4:]), key, 2).body.auth_bytes)

    def login() -> float:
        """One login; the CPU the client's side took, to take out."""
        if mechanism == "PLAIN":
            send(SASL_AUTHENTICATE, auth_bytes=f"\x00{USER}\x00{PASSWORD}".encode())
            return 0.0
        c0 = time.process_time()
        client = ScramClient([mechanism], USER, PASSWORD)
        first = client.get_client_first().encode()
        own = time.process_time() - c0
        server_first = send(SASL_AUTHENTICATE, auth_bytes=first).decode()
        c0 = time.process_time()
        client.set_server_first(server_first)
        final = client.get_client_final().encode()
        own += time.process_time() - c0
        send(SASL_AUTHENTICATE, auth_bytes=final)
        return own

    for _ in range(2):                      # the login and the first re-authentication (never too soon)
        send(SASL_HANDSHAKE, mechanism=mechanism)
        login()
    assert t.reauth_started_at is not None
    own = 0.0
    started = time.process_time()
    for _ in range(loops):
        clock.now += step_s
        before = t.reauth_started_at
        send(SASL_HANDSHAKE, mechanism=mechanism)
        if t.reauth_started_at != before:  # begun: the client goes on with its login
            own += login()
    assert t.authenticated
    return (time.process_time() - started - own) / loops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cases: list[tuple[str, Callable[[], float]]] = [
        ("PLAIN, re-authentication begun (1 s apart)", lambda: per_loop("PLAIN", args.loops, 1.0)),
        ("PLAIN, handshake refused (1 ms apart)", lambda: per_loop("PLAIN", args.loops, 0.001)),
        ("SCRAM-SHA-256, re-authentication begun (1 s apart)", lambda: per_loop("SCRAM-SHA-256", args.loops, 1.0)),
        ("SCRAM-SHA-256, handshake refused (1 ms apart)", lambda: per_loop("SCRAM-SHA-256", args.loops, 0.001)),
    ]
    for name, case in cases:
        runs = [case() * 1e6 for _ in range(args.rounds)]
        print(f"{name:52s} {statistics.median(runs):9.1f} us CPU a loop "
              f"(rounds {min(runs):.1f}-{max(runs):.1f})")


if __name__ == "__main__":
    main()
