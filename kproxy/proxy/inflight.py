"""The completed-request entry (``InFlight``): one request from the moment the session reads it until
its answer is written, with its outcome, its decoded request and response, its four times and what
filters noted about it. Filters get it as the exchange; the server's statistics, metrics, spans and
traffic log are fed from it once it is complete. Plain data, sans-I/O.
"""

from __future__ import annotations

from typing import Any

import attrs

from kproxy.protocol.messages import Request, Response, decode_request

# Outcomes of a request (``InFlight.outcome``).
FORWARDED = "forwarded"          # the broker answered
LOCAL = "local"                  # kproxy answered (a filter, an unsupported version)
NO_RESPONSE = "no_response"      # acks=0 Produce: complete once written to the broker
UPSTREAM_LOST = "upstream_lost"  # the broker connection was lost or timed out first
PASSTHROUGH = "passthrough"      # forwarded opaquely (passthrough_unknown_versions)
CLIENT_GONE = "client_gone"      # the client went away before its answer was written
CLOSED = "closed"                # kproxy closed the connection first (a bad frame, a drain timeout, a fault)

# How an answer reached the client (``InFlight.path``): stored whole and then forwarded, or streamed
# while it arrived (cut-through, kproxy.proxy.streaming).
STORED, STREAMED = "stored", "streamed"


@attrs.define(slots=True, eq=False)
class InFlight:
    """A request from the moment it is read until its answer is written: the completed-request entry.

    Times come from the session's clock: ``started`` when the frame was read, ``forwarded_at`` when
    it was written to the broker, ``answered_at`` when the response was complete, ``finished_at``
    when the answer was written to the client (the last two stamped by the I/O layer).
    ``handling_s`` is the time the session spent on it: from reading the request until it was
    encoded for the broker, plus from ``answered_at`` until the answer was encoded for the client
    (decoding, filters and encoding; no waiting). Response filters see only the first part.
    """

    client_correlation_id: int
    api_key: int
    api_version: int
    started: float
    request: Request | None = None         # None for frames forwarded opaquely
    upstream_correlation_id: int | None = None
    reply: list | None = None              # the encoded response, once known
    close_after: str | None = None         # close the connection once this reply is sent
    request_bytes: int = 0
    response_bytes: int = 0                # as sent to the client, size prefix included
    outcome: str = FORWARDED
    response: Response | None = None       # the decoded answer (after filters), when there is one
    forwarded_at: float | None = None
    answered_at: float | None = None
    finished_at: float | None = None
    broker: tuple[str, int] | None = None  # the broker connection it went to
    throttle_ms: int = 0                   # throttle_time_ms as sent to the client
    handling_s: float = 0.0
    seq: int = 0                           # the request's place among the connection's requests
    # What filters decided about this request (rule names, quota keys), for metrics and logs.
    notes: dict[str, Any] | None = None
    # Each filter's own state from the request to its answer (keep / kept); dies with the entry.
    kept_by: dict[Any, Any] | None = None
    # Broker ports an answer names that no listener holds yet (the address rewriter's ``listen``).
    ports: list[int] | None = None
    # How the broker's answer reached the client (STORED or STREAMED); for a streamed one, what each
    # records field held (kproxy.proxy.streaming.RecordsFacts, in the answer's order), since the
    # decoded ``response`` then has its records left out.
    path: str = STORED
    records_facts: list | None = None
    spliced_bytes: int = 0                 # of a streamed answer, bytes spliced (never in kproxy's memory)
    # How the request reached the broker: STORED, or STREAMED while it arrived (a large Produce;
    # ``records_facts`` then says what its records held, the decoded ``request`` has them left out).
    request_path: str = STORED
    # Why a request large enough to stream was stored instead (kproxy.proxy.streaming.why_stored).
    why_stored: str | None = None
    # A streamed frame cut off part-way: "client" (it went away mid-frame) or "broker" (lost mid-frame).
    broken: str | None = None
    # The broker's answer as it arrived, without its 4-byte size prefix (0 until then, and for an
    # answer kproxy made up): what a fetch quota charges, as a Kafka broker charges a response's size.
    upstream_bytes: int = 0
    # Why an answer large enough to stream was stored whole instead (``why_stored``'s reason, or
    # "order" when an earlier answer was still owed); None for one that streamed or was never a candidate.
    response_why_stored: str | None = None
    # A response filter changed the answer (``Filter.reports_changes``): it is encoded again.
    response_changed: bool = False
    # The request's frame when it went to the broker undecoded (``Session``'s relay path: nothing
    # reads it); ``decoded_request`` decodes it the first time something needs it after all.
    relayed: Any = None
    # Which telemetry outputs sampled this exchange, decided when its request arrived (the bits of
    # ``kproxy.telemetry.outputs.sample``; 0: none, so it may be relayed undecoded); None when the
    # session did not decide (no output samples, or a request read before sampling): decided on completion.
    sampled: int | None = None
    # A Produce request relayed while metrics count it: its records in all, then (once the answer was
    # read from its bytes) in the partitions the answer reports no error for; and each partition's
    # ``(topic key, index, records)`` (``kproxy.proxy.produce_bytes``).
    produced: int | None = None
    produce_counts: list | None = None
    # A Fetch exchange relayed both ways while metrics count it: the records fetched, read from its
    # answer's bytes (``kproxy.proxy.fetch_bytes``).
    fetched: int | None = None

    def decoded_request(self) -> Request | None:
        """``request``, decoded now from the relayed frame if it went out undecoded (a lost broker
        connection answering it, the watchdog reading how long the broker may hold it, a large
        answer about to stream); None for a frame forwarded opaquely (an unknown version)."""
        if self.request is None and self.relayed is not None:
            req = decode_request(self.relayed, keep_trailing=True)
            if self.upstream_correlation_id is not None:
                req.correlation_id = self.upstream_correlation_id
            self.request, self.relayed = req, None
        return self.request

    def note(self, key: str, value: Any) -> None:
        if self.notes is None:
            self.notes = {}
        self.notes[key] = value

    def keep(self, owner: Any, value: Any) -> None:
        """Carry ``owner``'s (a filter's) state for this request to its on_response and on_done."""
        if self.kept_by is None:
            self.kept_by = {}
        self.kept_by[owner] = value

    def kept(self, owner: Any) -> Any:
        return self.kept_by.get(owner) if self.kept_by is not None else None

    def listen(self, port: int) -> None:
        """The answer names ``port``: it must be listening before the answer is written."""
        if self.ports is None:
            self.ports = [port]
        elif port not in self.ports:
            self.ports.append(port)
