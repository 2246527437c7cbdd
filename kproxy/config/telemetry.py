"""What kproxy shows about itself: the admin HTTP listener, Prometheus metrics, the traffic log and
OpenTelemetry tracing."""

import os

import attrs

from kproxy.config.checks import HostPort, SettingError, did_you_mean, path_of, setting, with_checks


@attrs.frozen(field_transformer=with_checks)
class AdminConfig:
    """The admin HTTP listener (health, metrics); off when ``listen`` is None."""

    listen: HostPort | None = None


@attrs.frozen(field_transformer=with_checks)
class MetricsConfig:
    """Prometheus metrics on the admin listener. Per-client and per-topic series are opt-in: their
    number grows with the clients and topics, so each kind is capped and the rest is counted as
    ``other``."""

    client_labels: bool = False
    topic_labels: bool = False
    label_cap: int = setting(100, min=1)


@attrs.frozen(field_transformer=with_checks)
class TrafficLogConfig:
    """One JSON line per completed request, under ``dir`` (off when None), in hourly partitions."""

    dir: str | None = setting(None, file=True)
    rotate_bytes: int = setting(67108864, min=4096)
    rotate_s: float = setting(3600.0, above=0)
    compression: str = setting("gzip", case="lower", choices=("gzip", "none"))
    queue_size: int = setting(10000, min=1)
    # API name -> share of its requests logged (0..1); "default" for the APIs not named.
    sample: dict[str, float] = attrs.field(factory=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        if self.dir is not None:
            problem = _writable_dir_problem(self.dir)
            if problem is not None:
                raise SettingError(path_of(self, "dir"), problem)
        if not self.sample:
            return
        from kproxy.protocol.messages import apis

        names = {api.name for api in apis().values()} | {"default"}
        for name, ratio in self.sample.items():
            if name not in names:
                raise SettingError(path_of(self, "sample"), f"unknown API {name!r}"
                                                            f"{did_you_mean(str(name), names)}")
            if type(ratio) not in (int, float) or not 0 <= ratio <= 1:
                raise SettingError((*path_of(self, "sample"), name), f"must be a number from 0 to 1, got {ratio!r}")


@attrs.frozen(field_transformer=with_checks)
class TracingConfig:
    """OpenTelemetry spans, one per request; exported as the OTEL_* environment variables say."""

    enabled: bool = False
    sample_ratio: float = setting(1.0, min=0, max=1)
    # Read W3C traceparent headers of records: off, uncompressed batches only, or all (decompressing,
    # up to limits.max_decompressed_batch_bytes per batch).
    link_record_traces: str = setting("uncompressed", case="lower", choices=("off", "uncompressed", "all"))
    # otlp, console or none; null: OTEL_TRACES_EXPORTER, else otlp.
    exporter: str | None = setting(None, case="lower", choices=("otlp", "console", "none"))


def _writable_dir_problem(path: str) -> str | None:
    """Why kproxy could not write files under ``path`` (created at start when missing), or None."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"not a directory: {path}"
        return None if os.access(path, os.W_OK | os.X_OK) else f"cannot write to {path} (permissions)"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path}: {parent} is not a writable directory"
    return None
