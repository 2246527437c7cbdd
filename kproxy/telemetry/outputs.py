"""The telemetry outputs a proxy has switched on, fed from its single completion point.

``Telemetry.completed`` is called once per completed request, after its answer was written; it
builds the shared ``Exchange`` once and hands it to metrics, the traffic log (sampled per API) and
spans. With every output off the proxy does not call it at all. No trio: the server gives it the
offset between its clock and the epoch once, at start.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping

from kproxy.config import ConfigError, ProxyConfig
from kproxy.protocol.messages import apis
from kproxy.proxy.filters import ConnectionContext
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.topics import TopicNames
from kproxy.telemetry.exchange import Exchange, Learned
from kproxy.telemetry.metrics import Metrics, tracing_families, traffic_log_families
from kproxy.telemetry.spans import SpanExporter, Tracing
from kproxy.telemetry.traffic_log import TrafficLogWriter, proxy_name, traffic_line

log = logging.getLogger("kproxy.telemetry")


class Telemetry:
    """Metrics (when the admin listener is on), the traffic log and spans, as ``config`` asks."""

    def __init__(self, config: ProxyConfig, *, span_exporter: SpanExporter | None = None,
                 env: Mapping[str, str] = os.environ, topic_names: TopicNames | None = None) -> None:
        self.metrics = Metrics(config.metrics) if config.admin.listen is not None else None
        tl = config.traffic_log
        self.traffic_log = TrafficLogWriter(tl) if tl.dir is not None else None
        tr = config.tracing
        # Topic names of topic ids are learned from every Metadata answer, which means reading every
        # topic of it (milliseconds on a cluster of 100,000 partitions): only when something names
        # topics of Produce and Fetch v13+ (the traffic log, spans, per-topic metrics).
        self.learned = Learned(learn_topics=tl.dir is not None or tr.enabled or (
            self.metrics is not None and config.metrics.topic_labels), topic_names=topic_names)
        try:
            self.tracing = (Tracing(tr, config.limits.max_decompressed_batch_bytes, span_exporter, env)
                            if tr.enabled else None)
        except ValueError as e:   # an OTEL_* variable kproxy cannot follow
            raise ConfigError(f"tracing: {e}") from None
        default = float(tl.sample.get("default", 1.0))
        self._log_ratio = {key: float(tl.sample.get(api.name, default)) for key, api in apis().items()}
        self._log_default = default
        self._random = random.Random().random
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

    @property
    def active(self) -> bool:
        return self.metrics is not None or self.traffic_log is not None or self.tracing is not None

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

    def completed(self, entry: InFlight, ctx: ConnectionContext) -> None:
        x = Exchange(entry, ctx, self.learned)
        self.learned.observe(entry, ctx)
        if self.metrics is not None:
            self.metrics.record(x)
        writer = self.traffic_log
        if writer is not None:
            ratio = self._log_ratio.get(entry.api_key, self._log_default)
            if ratio >= 1.0 or self._random() < ratio:
                writer.offer(traffic_line(x, self.epoch_offset, self.proxy))
        if self.tracing is not None:
            self.tracing.emit(x, self.epoch_ns)

    def close(self) -> None:
        """Write out what is queued: the traffic log's last lines and the spans not yet exported."""
        if self.traffic_log is not None:
            self.traffic_log.close()
        if self.tracing is not None:
            self.tracing.shutdown()
