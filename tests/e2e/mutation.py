"""Mutated Kafka request frames for socket-level attack runs (the e2e security tests and bench/attack.py).

A corpus of valid requests (every API at its lowest and highest version, default-valued bodies) is
mutated the way a fuzzer or a hostile client would: flipped bytes, truncation, inserted junk, huge
lengths and counts, other api keys and versions. Deterministic for a given random.Random.
"""

from __future__ import annotations

import contextlib
import random

from kproxy.protocol.errors import KProxyError
from kproxy.protocol.messages import Request, apis, body_class, encode_request_frame

HUGE = (b"\x7f\xff\xff\xff", b"\xff\xff\xff\xfe", b"\x00\x10\x00\x00")


def request_corpus() -> list[bytes]:
    """One valid request frame (without its size prefix) per API at its lowest and highest version."""
    out = []
    for key, api in sorted(apis().items()):
        msg = api.request
        assert msg is not None and msg.versions.hi is not None
        for v in sorted({msg.versions.lo, msg.versions.hi}):
            # A few versions cannot encode an all-defaults body (a required non-null field): skip those.
            with contextlib.suppress(KProxyError):
                req = Request.build(key, v, 7, "attacker", body_class(key, "request")())
                out.append(b"".join(bytes(b) for b in encode_request_frame(req))[4:])
    return out


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and b:                               # flip a byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:                             # truncate
            del b[rng.randrange(len(b)):]
        elif op == 2:                                   # insert junk
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and len(b) >= 12:                  # a huge length or count somewhere
            i = rng.randrange(8, len(b) - 3)
            b[i:i + 4] = rng.choice(HUGE)
        elif op == 4 and len(b) >= 2:                   # another api key or version
            b[rng.randrange(2)] = rng.randrange(256)
    return bytes(b)
