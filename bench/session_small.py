"""The sans-I/O session's share of a small request: a Metadata v12 request (no topics) and its answer
through ``Session.client_frame`` and ``upstream_frame`` with the address rewriter, as a server
without rules runs them, with and without remembered answers (``kproxy.proxy.memo``).

Run:  ``.venv/bin/python bench/session_small.py [--rounds 5] [--n 20000]``

CPU time of this process in alternating batches; each figure is the median over rounds, in
microseconds per request and answer. Before timing, both ways must give the client the same bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kproxy.protocol.messages import (
    Request,
    Response,
    body_class,
    encode_request_frame,
    encode_response_frame,
)
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.memo import AnswerMemo
from kproxy.proxy.session import Session

METADATA = 3


class Loop:
    """One connection's session, and the request and answer it is fed."""

    def __init__(self, memo: AnswerMemo | None) -> None:
        amap = AddressMap("kproxy.example", 19000, 16)
        self.amap = amap
        self.session = Session(ConnectionContext(1, clock=time.monotonic), FilterChain([AddressRewriter(amap)]),
                               memo=memo)
        cls = body_class(METADATA, "response")
        body = cls(cluster_id="bench-cluster", controller_id=1,
                   brokers=[cls.MetadataResponseBroker(node_id=1, host="127.0.0.1", port=9092)])
        self.answer_tail = b"".join(encode_response_frame(Response.build(METADATA, 12, 0, body)))[8:]
        request = Request.build(METADATA, 12, 7, "bench", body_class(METADATA, "request")(topics=[]))
        self.request = memoryview(b"".join(encode_request_frame(request))[4:])

    def once(self) -> bytes:
        session = self.session
        out = session.client_frame(self.request)
        upstream_id = bytes(out[-1].buffers[0][8:12])
        out = session.upstream_frame(memoryview(upstream_id + self.answer_tail))
        sent = out[-1]
        for entry in sent.done:
            session.finish(entry)
        for port in self.amap.pending_ports():
            self.amap.confirm(port)
        return b"".join(bytes(b) for b in sent.buffers)

    def per_request_us(self, n: int) -> float:
        once = self.once
        t = time.process_time()
        for _ in range(n):
            once()
        return (time.process_time() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=20000, help="requests per batch")
    args = ap.parse_args()
    plain, memo = Loop(None), Loop(AnswerMemo())
    for _ in range(3):      # ports confirmed, the answer remembered, codecs warm
        a, b = plain.once(), memo.once()
    if a != b:
        raise SystemExit("the remembered answer differs from the one built anew")
    times: dict[str, list[float]] = {"decode, rewrite, encode": [], "remembered": []}
    for _ in range(args.rounds):
        times["decode, rewrite, encode"].append(plain.per_request_us(args.n))
        times["remembered"].append(memo.per_request_us(args.n))
    for name, xs in times.items():
        print(f"{name:<26}{statistics.median(xs):8.1f} us per request and answer")


if __name__ == "__main__":
    main()
