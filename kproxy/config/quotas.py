"""How client quotas measure rates, and how a fleet of kproxy processes shares them
(``quota.coordination``). The quotas themselves are rules (kproxy/policy); this is how they are
enforced."""

import re
from typing import Final

import attrs

from kproxy.config.checks import SettingError, path_of, setting, with_checks

_TOPIC_NAME: Final = re.compile(r"[a-zA-Z0-9._-]{1,249}")


@attrs.frozen(field_transformer=with_checks)
class CoordinationConfig:
    """Fleet-wide quotas (docs/fleet-quotas.md): every process of ``fleet`` reports its use of each
    budget to ``topic`` every ``publish_interval_ms`` and enforces its demand-weighted share of the
    whole limit; peers silent for ``stale_after_s`` are ignored, and without fresh coordination a
    process falls back to the static share (limit / (quota_replicas x workers))."""

    fleet: str = setting()
    # false keeps the section written but off (charts template it in and switch it with one flag).
    enabled: bool = True
    topic: str = setting("__kproxy_quotas")
    publish_interval_ms: int = setting(500, min=50, max=60000)
    stale_after_s: float = setting(5.0, above=0, max=3600)
    # Used when kproxy creates the topic (an existing one is used as it is).
    partitions: int = setting(1, min=1, max=1000)
    replication_factor: int = setting(-1, min=-1, max=32)     # -1: the broker's default
    retention_ms: int = setting(300000, min=1000)

    def __attrs_post_init__(self) -> None:
        if not self.fleet.strip() or "/" in self.fleet or len(self.fleet) > 200:
            raise SettingError(path_of(self, "fleet"), f"{self.fleet!r} is not a fleet name (1 to 200 characters, "
                                                       f"no '/')")
        if not _TOPIC_NAME.fullmatch(self.topic) or self.topic in (".", ".."):
            raise SettingError(path_of(self, "topic"), f"{self.topic!r} is not a Kafka topic name "
                                                       f"(letters, digits, '.', '_', '-'; at most 249)")
        if self.replication_factor == 0:
            raise SettingError(path_of(self, "replication_factor"), "must be -1 (the broker's default) or at least 1")
        if self.stale_after_s * 1000 < 2 * self.publish_interval_ms:
            raise SettingError(path_of(self, "stale_after_s"),
                               f"must be at least two publish intervals ({2 * self.publish_interval_ms / 1000:g}s), "
                               f"got {self.stale_after_s:g}: every record would be stale before the next is read")


@attrs.frozen(field_transformer=with_checks)
class QuotaConfig:
    """How client quotas measure rates (Kafka's quota.window.num and quota.window.size.seconds):
    ``samples`` sliding samples of ``window_s`` seconds each; ``coordination`` shares every quota
    across a fleet of kproxy processes (off when None)."""

    samples: int = setting(11, min=1, max=3600)
    window_s: float = setting(1.0, above=0, max=3600)
    coordination: CoordinationConfig | None = None

    @property
    def coordinated(self) -> CoordinationConfig | None:
        """The coordination settings when fleet quotas are on, else None."""
        c = self.coordination
        return c if c is not None and c.enabled else None
