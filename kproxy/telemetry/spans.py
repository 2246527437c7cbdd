"""OpenTelemetry spans: one SERVER span per request with a CLIENT child for the broker round trip, and
the latency split (queued, broker, return) on it, built after the response was sent.

``span_name`` and ``span_attributes`` are pure; ``Tracing`` owns the SDK's tracer provider and a
batch processor that exports from its own thread. Unsampled requests cost one random draw. Span
attributes carry names, sizes and decisions, never record keys, values or credentials.
"""

from __future__ import annotations

import logging
import os
import random
import re
from collections.abc import Mapping
from typing import Any

import attrs
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from kproxy import __version__
from kproxy.config import TracingConfig
from kproxy.protocol.errors import DecodeError
from kproxy.protocol.records import V2_HEADER_SIZE, Compression, RecordBatch, iter_batches
from kproxy.telemetry.exchange import FETCH, PRODUCE, Exchange

log = logging.getLogger("kproxy.telemetry")

# messaging.operation.type by api key (OpenTelemetry messaging conventions).
OPERATION_TYPES: Mapping[int, str] = {
    0: "send",        # Produce
    1: "receive",     # Fetch
    78: "receive",    # ShareFetch
    8: "settle",      # OffsetCommit
    28: "settle",     # TxnOffsetCommit
    79: "settle",     # ShareAcknowledge
}
MAX_LINKS = 64   # per span: a batch of thousands of traced records must not make a huge span
# A record header key "traceparent" as the v2 record format writes it (zigzag varint length 11). A
# batch without these bytes has no such header, and is skipped without parsing its records.
_TRACEPARENT_KEY = re.compile(rb"\x16traceparent")


def span_name(x: Exchange) -> str:
    topics = x.topics
    return f"{x.api} {topics[0]}" if len(topics) == 1 else x.api


def span_attributes(x: Exchange) -> dict[str, Any]:
    """The SERVER span's attributes (messaging conventions where they fit, kproxy.* for the rest)."""
    e, ctx = x.entry, x.ctx
    duration, queued, broker, ret = x.split_ms()
    a: dict[str, Any] = {
        "messaging.system": "kafka",
        "messaging.operation.name": x.api,
        "kafka.api.version": e.api_version,
        "kproxy.outcome": e.outcome,
        "kproxy.connection_id": ctx.connection_id,
        "kproxy.virtual_cluster": x.virtual_cluster,
        "kproxy.listener": ctx.listener,
        "kproxy.request_bytes": e.request_bytes,
        "kproxy.response_bytes": e.response_bytes,
        "kproxy.duration": duration,
        "kproxy.throttle_ms": int(e.throttle_ms or 0),
    }
    op = OPERATION_TYPES.get(e.api_key)
    if op is not None:
        a["messaging.operation.type"] = op
    for key, value in (("kproxy.queued", queued), ("kproxy.broker", broker), ("kproxy.return", ret)):
        if value is not None:
            a[key] = value
    topics = x.topics
    if len(topics) == 1:
        a["messaging.destination.name"] = topics[0]
    elif topics:
        a["kproxy.topics"] = topics[:32]
    if ctx.client_id is not None:
        a["messaging.client.id"] = ctx.client_id
    group = x.group
    if group is not None:
        a["messaging.consumer.group.name"] = group
    if ctx.principal is not None:
        a["kproxy.principal"] = ctx.principal
    if ctx.client_address is not None:
        a["client.address"], a["client.port"] = ctx.client_address
    if e.broker is not None:
        a["server.address"], a["server.port"] = e.broker
    if e.api_key in (PRODUCE, FETCH):
        parts = x.partitions
        a["messaging.batch.message_count"] = sum(p.records for p in parts)
        if len(parts) == 1:
            a["messaging.destination.partition.id"] = str(parts[0].partition)
        if e.api_key == FETCH and x.max_wait_ms is not None:
            a["kproxy.max_wait_ms"] = x.max_wait_ms
    error = x.error
    if error is not None:
        a["error.type"] = error
    notes = e.notes or {}
    for key in ("rule", "action", "record_rule"):
        if notes.get(key) is not None:
            a[f"kproxy.{key}"] = str(notes[key])
    for key in ("encrypted_batches", "decrypted_batches"):
        if notes.get(key):
            # Record encryption acted on this request's batches (docs/encryption.md).
            a[f"kproxy.{key}"] = int(notes[key])
    quota = notes.get("quota")
    if isinstance(quota, dict):
        a["kproxy.quota.rule"] = str(quota.get("rule", ""))
        a["kproxy.quota.throttle_ms"] = int(quota.get("throttle_ms", 0) or 0)
    return a


def parse_traceparent(value: Any) -> SpanContext | None:
    """A W3C trace context ``traceparent`` header value (version 00) as a remote span context."""
    if value is None or len(value) < 55:
        return None
    try:
        text = bytes(value[:55]).decode("ascii")
    except UnicodeDecodeError:
        return None
    parts = text.split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 0x01))


def record_links(x: Exchange, mode: str, max_decompressed: int) -> list[Link]:
    """Links to the traces named by records' ``traceparent`` headers (Produce requests, Fetch
    responses). ``mode``: "uncompressed" reads only uncompressed batches, "all" decompresses too."""
    e = x.entry
    fields: list[Any] = []
    if e.api_key == PRODUCE and e.request is not None:
        fields = [pd.records for t in e.request.body.topic_data for pd in t.partition_data]
    elif e.api_key == FETCH and e.response is not None and e.response.api_key == FETCH:
        fields = [pd.records for t in e.response.body.responses for pd in t.partitions]
    links: list[Link] = []
    seen: set[tuple[int, int]] = set()
    for records in fields:
        if records is None:
            continue
        try:
            for batch in iter_batches(records):
                if not isinstance(batch, RecordBatch) or batch.is_control:
                    continue
                if batch.compression is Compression.NONE:
                    if _TRACEPARENT_KEY.search(batch.raw, V2_HEADER_SIZE) is None:
                        continue
                elif mode != "all" or _TRACEPARENT_KEY.search(batch.payload(max_decompressed)) is None:
                    continue
                for rec in batch.records(max_decompressed):
                    for h in rec.headers:
                        if h.key != "traceparent":
                            continue
                        sc = parse_traceparent(h.value)
                        if sc is None or (sc.trace_id, sc.span_id) in seen:
                            continue
                        seen.add((sc.trace_id, sc.span_id))
                        links.append(Link(sc))
                        if len(links) >= MAX_LINKS:
                            return links
        except DecodeError:
            continue  # a batch kproxy cannot read is the broker's or client's business, not a span's
    return links


class ChosenIds(IdGenerator):
    """Random ids, except for the next span when its ids were chosen before it is created: a headers
    rule puts the produce span's trace context into records at request time, and the span, built
    once the request is complete, must carry those very ids. Used from the event loop only."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._trace_id: int | None = None
        self._span_id: int | None = None

    def choose(self, trace_id: int, span_id: int) -> None:
        self._trace_id, self._span_id = trace_id, span_id

    def generate_trace_id(self) -> int:
        chosen, self._trace_id = self._trace_id, None
        return chosen if chosen is not None else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        chosen, self._span_id = self._span_id, None
        return chosen if chosen is not None else self._random.generate_span_id()


def default_exporter(cfg: TracingConfig, env: Mapping[str, str] = os.environ) -> SpanExporter | None:
    """The exporter the config and the OTEL_* variables ask for; None for "none"."""
    kind = cfg.exporter or (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    if kind == "none":
        return None
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: kproxy exports spans with otlp, console or none")
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http()
    raise ValueError(f"OTLP protocol {protocol!r} is not supported: use grpc or http/protobuf")


def _resource(env: Mapping[str, str]) -> Resource:
    resource = Resource.create({})
    named = "OTEL_SERVICE_NAME" in env or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return resource if named else resource.merge(Resource({"service.name": "kproxy"}))


class Tracing:
    """Spans for completed requests. ``exporter`` None: the one the config and environment choose."""

    def __init__(self, cfg: TracingConfig, max_decompressed: int, exporter: SpanExporter | None = None,
                 env: Mapping[str, str] = os.environ, seed: int | None = None) -> None:
        self.cfg = cfg
        self.max_decompressed = max_decompressed
        # OTEL_TRACES_SAMPLER, when set, is the SDK's to apply; otherwise kproxy samples first, so an
        # unsampled request never builds attributes.
        env_sampler = "OTEL_TRACES_SAMPLER" in env
        self.env_sampler = env_sampler
        self.ratio = 1.0 if env_sampler else cfg.sample_ratio
        self._random = random.Random(seed).random
        self.ids = ChosenIds()
        self.provider = TracerProvider(sampler=None if env_sampler else ALWAYS_ON, resource=_resource(env),
                                       shutdown_on_exit=False, span_limits=SpanLimits(max_links=MAX_LINKS),
                                       id_generator=self.ids)
        if exporter is None:
            exporter = default_exporter(cfg, env)
        self.exporter = exporter
        if exporter is not None:
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kproxy", __version__)
        self.spans = 0

    def describe(self, env: Mapping[str, str] = os.environ) -> str:
        exp = type(self.exporter).__name__ if self.exporter is not None else "no exporter"
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        where = f" to {endpoint}" if endpoint and "OTLP" in exp else ""
        sampler = env.get("OTEL_TRACES_SAMPLER")
        return (f"tracing on: {exp}{where}, "
                + (f"sampler {sampler} (OTEL_TRACES_SAMPLER)" if sampler else f"sampling {self.ratio:g}"))

    def set_ratio(self, ratio: float) -> str:
        """A reloaded ``tracing.sample_ratio`` (SIGHUP); '' when it is in force, else why not."""
        self.cfg = attrs.evolve(self.cfg, sample_ratio=ratio)
        if self.env_sampler:
            return " (not in force: OTEL_TRACES_SAMPLER samples instead)"
        self.ratio = ratio
        return ""

    def sampled(self) -> bool:
        """Whether the next request gets spans (one draw below ratio 1, none at 1)."""
        return self.ratio >= 1.0 or self._random() < self.ratio

    def emit(self, x: Exchange, epoch_ns: int, sampled: bool | None = None) -> None:
        """Build and end the spans of one completed request; ``epoch_ns`` converts its clock.
        ``sampled``: the draw made when its request arrived (``sampled()``); None: drawn now."""
        e = x.entry
        chosen = (e.notes or {}).get("trace_context")
        # Records name a span whose ids were chosen at request time: it is always exported, or the
        # consumers' traces would point at a span nobody has.
        if chosen is None and not (self.sampled() if sampled is None else sampled):
            return
        name = span_name(x)
        links = record_links(x, self.cfg.link_record_traces, self.max_decompressed) \
            if self.cfg.link_record_traces != "off" and e.api_key in (PRODUCE, FETCH) else ()
        end = e.finished_at if e.finished_at is not None else e.started
        if chosen is not None:
            self.ids.choose(*chosen)
        span = self.tracer.start_span(name, kind=SpanKind.SERVER, attributes=span_attributes(x), links=links,
                                      start_time=int(e.started * 1e9) + epoch_ns)
        error = x.error
        if e.forwarded_at is not None:
            child = self.tracer.start_span(name, context=trace.set_span_in_context(span), kind=SpanKind.CLIENT,
                                           start_time=int(e.forwarded_at * 1e9) + epoch_ns)
            if e.broker is not None:
                child.set_attribute("server.address", e.broker[0])
                child.set_attribute("server.port", e.broker[1])
            child.set_attribute("messaging.system", "kafka")
            child.set_attribute("messaging.operation.name", x.api)
            child.set_attribute("kproxy.virtual_cluster", x.virtual_cluster)
            answered = e.answered_at if e.answered_at is not None else (e.finished_at or e.forwarded_at)
            if e.answered_at is None and e.outcome not in ("no_response", "client_gone"):
                child.set_status(Status(StatusCode.ERROR, e.outcome))
            child.end(int(answered * 1e9) + epoch_ns)
        if e.outcome in ("client_gone", "closed"):
            # Not kproxy's error nor the broker's (client_gone: a consumer closing in a long poll is
            # normal): the status stays unset, and an event says why the answer was never written.
            span.add_event(f"kproxy.{e.outcome}", timestamp=int(end * 1e9) + epoch_ns)
        elif error is not None or e.outcome == "upstream_lost":
            span.set_status(Status(StatusCode.ERROR, error or e.outcome))
        span.end(int(end * 1e9) + epoch_ns)
        self.spans += 1

    def shutdown(self) -> None:
        self.provider.shutdown()
