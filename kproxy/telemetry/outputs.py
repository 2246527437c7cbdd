"""The telemetry outputs a process has switched on, fed from each virtual cluster's single
completion point.

``TelemetryOutputs`` is the process's: metrics, the traffic log and spans. ``Telemetry.completed``
(one ``Telemetry`` per virtual cluster) is called once per completed request, after its answer was
written; it builds the shared ``Exchange`` once, naming the virtual cluster, and hands it to the
cluster's metrics, the traffic log (sampled per API) and spans. Both samples are drawn as the
request arrives (``sample``), so the session relays undecoded what neither samples. With every output off the proxy does
not call it at all. No trio: the server gives it the offset between its clock and the epoch once, at
start.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Mapping

from kproxy.config import ConfigError, ProxyConfig
from kproxy.protocol.messages import apis
from kproxy.proxy.filters import ConnectionContext
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.topics import TopicNames
from kproxy.telemetry.exchange import FETCH, PRODUCE, Exchange, Learned
from kproxy.telemetry.metrics import Metrics, ProcessMetrics, tracing_families, traffic_log_families
from kproxy.telemetry.spans import SpanExporter, Tracing
from kproxy.telemetry.traffic_log import TrafficLogWriter, proxy_name, traffic_line

log = logging.getLogger("kproxy.telemetry")

# The outputs that sample an exchange (``TelemetryOutputs.sample``, ``InFlight.sampled``).
LOGGED, SPANNED = 1, 2


class TelemetryOutputs:
    """What a process writes telemetry to, as ``config`` asks: its metrics (when the admin listener is
    on), the traffic log and spans. The virtual clusters of the process share them, each through its
    own ``Telemetry`` (``for_cluster``)."""

    def __init__(self, config: ProxyConfig, *, span_exporter: SpanExporter | None = None,
                 env: Mapping[str, str] = os.environ) -> None:
        self.metrics = ProcessMetrics(config.metrics) if config.admin.listen is not None else None
        tl = config.traffic_log
        self.traffic_log = TrafficLogWriter(tl) if tl.dir is not None else None
        tr = config.tracing
        # Topic names of topic ids are learned from every Metadata answer, which means reading every
        # topic of it (milliseconds on a cluster of 100,000 partitions): only when something names
        # topics of Produce and Fetch v13+ (the traffic log, spans, per-topic metrics).
        self.learn_topics = tl.dir is not None or tr.enabled or (
            self.metrics is not None and config.metrics.topic_labels)
        # What metrics read decoded: Produce and Fetch when they count records by topic (names and
        # bytes per topic); else their counts come from the bytes as they are relayed
        # (``kproxy.proxy.produce_bytes``, ``kproxy.proxy.fetch_bytes``).
        self.metrics_read = frozenset({PRODUCE, FETCH} if config.metrics.topic_labels else ())
        try:
            self.tracing = (Tracing(tr, config.limits.max_decompressed_batch_bytes, span_exporter, env)
                            if tr.enabled else None)
        except ValueError as e:   # an OTEL_* variable kproxy cannot follow
            raise ConfigError(f"tracing: {e}") from None
        self.random = random.Random().random
        self.log_sample: Mapping[str, float] = {}
        self._set_log_sample(tl.sample)
        self.proxy = proxy_name()
        self.epoch_offset = 0.0      # seconds to add to the session clock for the epoch
        self.epoch_ns = 0
        if self.metrics is not None:
            if self.traffic_log is not None:
                writer = self.traffic_log
                self.metrics.add_reader(lambda: traffic_log_families(writer))
            if self.tracing is not None:
                tracing = self.tracing
                self.metrics.add_reader(lambda: tracing_families(tracing))

    def _set_log_sample(self, sample: Mapping[str, float]) -> None:
        self.log_sample = dict(sample)
        default = float(sample.get("default", 1.0))
        self.log_ratio = {key: float(sample.get(api.name, default)) for key, api in apis().items()}
        self.log_default = default
        # Whether the traffic log or spans leave some exchanges out (``sampler``).
        self.draws = ((self.traffic_log is not None and min([*self.log_ratio.values(), default]) < 1.0)
                      or (self.tracing is not None and self.tracing.ratio < 1.0))

    def set_sampling(self, config: ProxyConfig) -> list[str]:
        """Take the traffic log's and spans' sample ratios from ``config`` (a reloaded file, SIGHUP).
        The next request draws by them on every connection: the ratios are read on each request, and
        an exchange a connection opened before did not draw for is drawn for at completion. A
        connection opened while nothing sampled below 1 keeps reading every exchange whole until it
        reconnects (its lines follow the new ratios; only the relay saving waits). Returns what
        changed, one ``setting: old -> new`` each."""
        changed = []
        tl = config.traffic_log.sample
        if self.traffic_log is not None and tl != self.log_sample:
            changed.append(f"traffic_log.sample: {_ratios(self.log_sample)} -> {_ratios(tl)}")
            self._set_log_sample(tl)
        tracing = self.tracing
        if tracing is not None and config.tracing.sample_ratio != tracing.cfg.sample_ratio:
            changed.append(f"tracing.sample_ratio: {tracing.cfg.sample_ratio:g} -> "
                           f"{config.tracing.sample_ratio:g}" + tracing.set_ratio(config.tracing.sample_ratio))
            self._set_log_sample(self.log_sample)
        return changed

    @property
    def active(self) -> bool:
        return self.metrics is not None or self.traffic_log is not None or self.tracing is not None

    def decoded_apis(self) -> frozenset[int] | None:
        """The api keys whose exchanges telemetry reads decoded, besides those the traffic log and
        spans sample (``sampler``); None for every one. The traffic log and spans name topics, groups
        and every error of an answer, so they read every exchange they sample: all of them when
        neither samples below 1. Metrics count requests, bytes, latency, outcomes and the broker's
        throttle time, which the session takes from the frames' headers and sizes (it decodes the few
        answers whose throttle time is not their first field), so they read Produce and Fetch only
        when they count by topic: else the session reads a relayed Produce's record counts and its
        answer's errors and throttle time, and a relayed Fetch's records fetched and throttle time,
        from the bytes."""
        if (self.traffic_log is not None or self.tracing is not None) and self.sampler() is None:
            return None
        return self.metrics_read if self.metrics is not None else frozenset()

    def sampler(self) -> Callable[[int], int] | None:
        """``sample``, when the traffic log or spans leave some exchanges out (a ratio below 1): the
        session asks it as each request arrives, and relays the exchanges no output samples as it
        does without them. None when every exchange is sampled (or neither output is on)."""
        return self.sample if self.draws else None

    def sample(self, api_key: int) -> int:
        """Which outputs sample an exchange of ``api_key`` (``LOGGED``, ``SPANNED``): one draw per
        output whose ratio for it is between 0 and 1, as its request arrives. The ratios are read each time."""
        sampled = 0
        if self.traffic_log is not None:
            ratio = self.log_ratio.get(api_key, self.log_default)
            if ratio >= 1.0 or (ratio > 0.0 and self.random() < ratio):
                sampled = LOGGED
        tracing = self.tracing
        if tracing is not None and tracing.sampled():
            sampled |= SPANNED
        return sampled

    def for_cluster(self, name: str, topic_names: TopicNames | None = None) -> Telemetry:
        """The telemetry of the virtual cluster ``name``, whose topic names by id are ``topic_names``."""
        return Telemetry(self, name, topic_names)

    def start(self, clock_now: float) -> None:
        """Begin: ``clock_now`` is the session clock's reading at this moment."""
        self.epoch_offset = time.time() - clock_now
        self.epoch_ns = time.time_ns() - int(clock_now * 1e9)
        if self.traffic_log is not None:
            self.traffic_log.start()
            log.info("traffic log: writing to %s (dt=YYYY-MM-DD/hour=HH, %s)", self.traffic_log.root,
                     self.traffic_log.cfg.compression)
        if self.tracing is not None:
            log.info("%s", self.tracing.describe())
        if self.sampler() is not None:
            log.info("telemetry: exchanges that neither the traffic log nor spans sample are relayed "
                     "undecoded, as with metrics alone")

    def close(self) -> None:
        """Write out what is queued: the traffic log's last lines and the spans not yet exported."""
        if self.traffic_log is not None:
            self.traffic_log.close()
        if self.tracing is not None:
            self.tracing.shutdown()


class Telemetry:
    """One virtual cluster's telemetry: its own metrics and learned topic names, and the process's
    traffic log and spans, every line and span naming the virtual cluster."""

    def __init__(self, outputs: TelemetryOutputs, name: str, topic_names: TopicNames | None = None) -> None:
        self.outputs = outputs
        self.name = name
        self.metrics: Metrics | None = outputs.metrics.cluster(name) if outputs.metrics is not None else None
        self.learned = Learned(learn_topics=outputs.learn_topics, topic_names=topic_names,
                               learn_groups=outputs.traffic_log is not None or outputs.tracing is not None)

    @property
    def active(self) -> bool:
        return self.outputs.active

    def decoded_apis(self) -> frozenset[int] | None:
        return self.outputs.decoded_apis()

    def sampler(self) -> Callable[[int], int] | None:
        return self.outputs.sampler()

    def completed(self, entry: InFlight, ctx: ConnectionContext) -> None:
        out = self.outputs
        x = Exchange(entry, ctx, self.learned, self.name)
        self.learned.observe(entry, ctx)
        if self.metrics is not None:
            self.metrics.record(x)
        sampled = entry.sampled
        if sampled is None:         # not decided as the request arrived: now (no draw when all are at 1)
            sampled = out.sample(entry.api_key) if out.draws else LOGGED | SPANNED
        writer = out.traffic_log
        if writer is not None and sampled & LOGGED:
            writer.offer(traffic_line(x, out.epoch_offset, out.proxy))
        if out.tracing is not None:
            out.tracing.emit(x, out.epoch_ns, bool(sampled & SPANNED))


def _ratios(sample: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {ratio:g}" for name, ratio in sample.items()) + "}" if sample else "{} (all 1)"
