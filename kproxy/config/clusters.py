"""Virtual clusters: which settings belong to one virtual cluster and which to the whole process, and
the rules across virtual clusters (unique names and cluster ids, ports and SNI host names that never
collide), checked when the configuration is built, before anything binds.

One virtual cluster is what a single-cluster file configures: listeners, exposure, upstream, client
TLS and SASL, the PROXY protocol, rules and quotas. The process-wide settings (admin, metrics, the
traffic log, tracing, workers, logging, limits, the data path's tuning) are written once at the top.
Every virtual cluster is held as a whole ``ProxyConfig`` carrying the process-wide settings too, so
the code that serves one cluster reads one object, as before virtual clusters.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

import attrs

from kproxy.config.checks import SettingError, SettingPath

if TYPE_CHECKING:
    from kproxy.config.proxy import ProxyConfig

# Written once at the top level of a file with virtual_clusters; every other setting (bar
# virtual_clusters itself) belongs to each virtual cluster. A new setting is per virtual cluster
# unless it is listed here.
PROCESS_SETTINGS: Final = frozenset({
    "admin", "metrics", "traffic_log", "tracing", "workers", "log_level", "log_format", "limits",
    "quota_replicas", "verify_reencode", "cut_through_min_bytes", "cut_through_splice", "lane",
})
# Not settings of either kind: the list itself, and where the file was read from.
_NOT_CLUSTER_SETTINGS: Final = frozenset({"virtual_clusters", "source"})

# The name of the one virtual cluster of a file without virtual_clusters (metrics, logs, /readyz).
DEFAULT_NAME: Final = "default"

_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::"})

# A fixed namespace, so a virtual cluster's derived cluster id is the same in every process and release.
_CLUSTER_ID_NAMESPACE: Final = uuid.UUID("6b1f6e0c-5f55-4d0e-9a34-2a1b8d3c7e41")


def derived_cluster_id(virtual_cluster: str) -> str:
    """The cluster id a virtual cluster presents when ``cluster_id`` is not set: a UUID made from its
    name, written as Kafka writes one (22 characters of URL-safe base64, no padding)."""
    raw = uuid.uuid5(_CLUSTER_ID_NAMESPACE, f"kproxy virtual cluster {virtual_cluster}").bytes
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def cluster_settings(cls: type) -> tuple[str, ...]:
    """The settings of ``cls`` (ProxyConfig) that each virtual cluster has for itself."""
    return tuple(f.name for f in attrs.fields(cls)
                 if f.name not in PROCESS_SETTINGS and f.name not in _NOT_CLUSTER_SETTINGS)


def may_share(a: str, b: str) -> bool:
    """Whether listeners on hosts ``a`` and ``b`` collide on one port: only two distinct, specific
    addresses can each have it."""
    return a == b or a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS


@attrs.frozen
class _Claim:
    """Ports one virtual cluster binds: its listener, or its range of broker ports."""

    index: int
    host: str
    first: int
    last: int
    what: str               # "listen port 9092", "broker ports 9093..9156"
    path: SettingPath       # the setting to blame, inside virtual_clusters[index]
    sni_listener: bool      # the one port of an SNI virtual cluster, which others may share


def check_virtual_clusters(root: ProxyConfig) -> None:
    """The rules across the virtual clusters of ``root``; a SettingError names the setting to fix
    (``virtual_clusters[1].listen``), so the loader can point at its line."""
    clusters = root.virtual_clusters
    fields = {f.name for f in attrs.fields(type(root))}
    own = cluster_settings(type(root))
    for i, vc in enumerate(clusters):
        if vc.virtual_clusters:
            raise SettingError(("virtual_clusters", i, "virtual_clusters"), "virtual clusters do not nest")
        for key in sorted(PROCESS_SETTINGS & fields):
            if getattr(vc, key) != getattr(root, key):
                raise SettingError((key,), f"is process-wide: virtual cluster {vc.name!r} must have the top "
                                           f"level's value")
    first = clusters[0]
    for key in own:
        if getattr(root, key) != getattr(first, key):
            raise SettingError((key,), "with virtual_clusters, set it in each virtual cluster, not at the top level")
    seen: dict[str, int] = {}
    for i, vc in enumerate(clusters):
        key = vc.name.lower()
        if key in seen:
            raise SettingError(("virtual_clusters", i, "name"),
                               f"{vc.name!r} is already the name of virtual_clusters[{seen[key]}]")
        seen[key] = i
    _check_cluster_ids(root)
    _check_ports(root)


def _check_cluster_ids(root: ProxyConfig) -> None:
    """Each virtual cluster is one cluster to clients and tools (KIP-78): no two present one id."""
    ids: dict[str, int] = {}
    clusters = root.virtual_clusters
    for i, vc in enumerate(clusters):
        presented = vc.presented_cluster_id
        j = ids.get(presented)
        if j is not None:
            # Blame a cluster_id that is written (a derived one is the name's, which is unique).
            blamed = i if vc.cluster_id is not None else j
            other = clusters[j if blamed == i else i]
            raise SettingError(("virtual_clusters", blamed, "cluster_id"),
                               f"{presented!r} is also the cluster id of virtual cluster {other.name!r}; each "
                               f"virtual cluster presents its own")
        ids[presented] = i


def _claims(i: int, vc: ProxyConfig) -> Iterator[_Claim]:
    listen = vc.listen
    sni = vc.exposure.mode == "sni"
    yield _Claim(i, listen.host, listen.port, listen.port, f"listen port {listen.port}", ("listen",), sni)
    if not sni:
        start = vc.broker_port_start
        last = start + vc.exposure.broker_port_count - 1
        blame: SettingPath = ("listen",) if vc.exposure.broker_port_start is None else ("exposure",
                                                                                          "broker_port_start")
        yield _Claim(i, listen.host, start, last, f"broker ports {start}..{last}", blame, False)


def _check_ports(root: ProxyConfig) -> None:
    clusters = root.virtual_clusters
    claims = [c for i, vc in enumerate(clusters) for c in _claims(i, vc)]
    for n, later in enumerate(claims):
        for earlier in claims[:n]:
            if earlier.index == later.index or not may_share(earlier.host, later.host):
                continue
            if earlier.last < later.first or later.last < earlier.first:
                continue
            a, b = clusters[earlier.index], clusters[later.index]
            where = ("virtual_clusters", later.index)
            if earlier.sni_listener and later.sni_listener and a.listen == b.listen:
                _check_shared_sni_port(a, later.index, b)
                continue
            shared = max(earlier.first, later.first)
            hint = ""
            if earlier.sni_listener and later.sni_listener:
                hint = "; virtual clusters share a port only with exactly the same listen address"
            raise SettingError((*where, *later.path), f"{later.what} on {later.host}: port {shared} is already "
                                                      f"taken by the {earlier.what} of virtual cluster {a.name!r} "
                                                      f"on {earlier.host}{hint}")


def _check_shared_sni_port(a: ProxyConfig, j: int, b: ProxyConfig) -> None:
    """Two SNI virtual clusters on one listen address: the ClientHello's host name picks the virtual
    cluster, so no name may be served by both, and the bytes before it must be read alike."""
    assert a.exposure.sni is not None and b.exposure.sni is not None
    domain_a = a.exposure.sni.domain.lower().rstrip(".")
    domain_b = b.exposure.sni.domain.lower().rstrip(".")
    if domain_a == domain_b:
        # Names are broker-<id>.<domain>, controller-<id>.<domain> and <bootstrap_name>.<domain>: one
        # label under the domain, so only the same domain can give two virtual clusters one name.
        raise SettingError(("virtual_clusters", j, "exposure", "sni", "domain"),
                           f"{b.exposure.sni.domain} is already the SNI domain of virtual cluster {a.name!r} on "
                           f"the same port {b.listen}; virtual clusters sharing a port need different domains")
    if a.proxy_protocol != b.proxy_protocol:
        raise SettingError(("virtual_clusters", j, "proxy_protocol"),
                           f"differs from virtual cluster {a.name!r}'s on the same port {b.listen}: the PROXY "
                           f"header is read before the host name that picks the virtual cluster")
