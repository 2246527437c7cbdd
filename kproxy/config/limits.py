"""Bounds on what kproxy holds and uses: the ``limits`` section, and the two amounts kproxy derives
from the machine when the file leaves them to it (the process-wide buffer budget from the cgroup
memory limit, the number of workers from the CPUs). Those two read cgroup files; nothing else here
does I/O."""

import math
import os
from typing import TYPE_CHECKING, Final

import attrs

from kproxy.config.checks import setting, with_checks

if TYPE_CHECKING:
    from kproxy.config.proxy import ProxyConfig


@attrs.frozen(field_transformer=with_checks)
class LimitsConfig:
    """Bounds on what connections may make kproxy hold; sizes in bytes, durations in seconds."""

    max_frame_size: int = setting(104857600, min=1)
    max_in_flight_requests: int = setting(256, min=1)  # per client connection
    max_buffered_bytes: int = setting(67108864, min=1)  # per connection, before backpressure
    # All connections together; None: derived at start (see effective_buffer_budget).
    max_buffered_bytes_total: int | None = setting(None, min=1)
    max_decompressed_batch_bytes: int = setting(268435456, min=1)
    # A connection part-way through a SASL exchange the broker has not accepted yet gets this long;
    # silent connections are the idle timeout's business.
    unauthenticated_idle_timeout_s: float = setting(30.0, above=0)
    # Kafka's connections.max.idle.ms is 10 minutes; 0: never.
    idle_timeout_s: float = setting(600.0, min=0)
    # From a frame's first byte to its last: a peer that trickles a frame cannot hold its buffer forever.
    frame_timeout_s: float = setting(30.0, above=0)
    tls_handshake_timeout_s: float = setting(10.0, above=0)  # client side
    drain_timeout_s: float = setting(10.0, min=0)


# A container's memory limit, cgroup v2 then v1. v1 reports "no limit" as a huge number.
_CGROUP_LIMIT_FILES: Final = ("memory.max", "memory/memory.limit_in_bytes")
_NO_CGROUP_LIMIT: Final = 1 << 60
_DEFAULT_BUFFER_BUDGET: Final = 1 << 30


def effective_buffer_budget(cfg: "ProxyConfig", cgroup_dir: str = "/sys/fs/cgroup") -> int:
    """The process-wide buffered-bytes budget: ``limits.max_buffered_bytes_total`` when set.

    Otherwise a quarter of the cgroup memory limit under ``cgroup_dir`` when one is readable (the
    rest is for Python, the codecs and the kernel's socket buffers), else 1 GiB.
    """
    total = cfg.limits.max_buffered_bytes_total
    if total is not None:
        return total
    for name in _CGROUP_LIMIT_FILES:
        try:
            with open(os.path.join(cgroup_dir, name), encoding="ascii") as f:
                text = f.read(64).strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isdigit() and 0 < int(text) < _NO_CGROUP_LIMIT:
            return max(1, int(text) // 4)
    return _DEFAULT_BUFFER_BUDGET


def effective_workers(cfg: "ProxyConfig", cgroup_dir: str = "/sys/fs/cgroup") -> int:
    """``cfg.workers``, with ``auto`` (0) resolved: the CPUs this process may use, capped by a cgroup
    CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) when one is set."""
    if cfg.workers:
        return cfg.workers
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpus(cgroup_dir)
    return max(1, min(cpus, quota)) if quota is not None else max(1, cpus)


def _cgroup_cpus(cgroup_dir: str) -> int | None:
    try:
        with open(os.path.join(cgroup_dir, "cpu.max"), encoding="ascii") as f:
            limit_text, period_text = f.read().split()[:2]
        if limit_text != "max":
            return math.ceil(int(limit_text) / int(period_text))
        return None
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(cgroup_dir, "cpu", "cpu.cfs_quota_us"), encoding="ascii") as f:
            quota = int(f.read())
        with open(os.path.join(cgroup_dir, "cpu", "cpu.cfs_period_us"), encoding="ascii") as f:
            period = int(f.read())
        return math.ceil(quota / period) if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None
