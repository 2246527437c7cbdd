"""When the certificates kproxy loaded expire: ``expiry_of(path)`` reads a PEM file's notAfter with
``cryptography.x509``, and ``CertificateExpiry`` keeps one value per file for
``kproxy_tls_certificate_expiry_timestamp_seconds{file=...}``.

The server fills the process-wide ``CERTIFICATES`` at start for every certificate file it loads
(``tls.cert_file``, ``tls.ca_file``, ``upstream.tls.cert_file``, ``upstream.tls.ca_file``); code that
loads a certificate again (reloading on change) calls ``observe(path)`` on the server's registry
(``ProxyServer.certificates``, this one unless a test gave its own) after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger("kproxy.certificates")

METRIC = "kproxy_tls_certificate_expiry_timestamp_seconds"
# A CA bundle may hold a hundred certificates; anything beyond this is not a certificate file.
MAX_FILE_BYTES = 8 * 1024 * 1024


class CertificateError(ValueError):
    """A file holds no PEM certificate kproxy can read."""


def expiry_of(path: str | Path) -> float:
    """The earliest notAfter (seconds since the epoch) of the PEM certificates in ``path``.

    A chain or a CA bundle expires, for the purpose of an alert, when its first certificate does.
    Raises OSError when the file cannot be read and CertificateError when it holds no certificate.
    """
    p = Path(path)
    with p.open("rb") as fh:
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise CertificateError(f"{p}: larger than {MAX_FILE_BYTES} bytes; not a certificate file")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as e:
        raise CertificateError(f"{p}: no PEM certificate could be read ({e})") from None
    return min(c.not_valid_after_utc.timestamp() for c in certs)


class CertificateExpiry:
    """Expiry times by file, read by /metrics. The whole API is ``observe``, ``forget`` and
    ``families``: whoever (re)loads a certificate file calls ``observe(path)`` afterwards.

    Thread-safe (a lock around a small dict): the embedded proxy and tests read it from other threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expiry: dict[str, float] = {}

    def observe(self, path: str | Path) -> float | None:
        """Read ``path`` again and record its expiry; None (and a warning, the old value dropped)
        when it cannot be read, so an alert on a missing series can notice."""
        key = str(path)
        try:
            when = expiry_of(key)
        except (OSError, CertificateError) as e:
            log.warning("cannot read the expiry of certificate file %s: %s", key, e)
            with self._lock:
                self._expiry.pop(key, None)
            return None
        with self._lock:
            self._expiry[key] = when
        return when

    def forget(self, path: str | Path) -> None:
        with self._lock:
            self._expiry.pop(str(path), None)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._expiry)

    def families(self) -> Iterable[Metric]:
        g = GaugeMetricFamily(METRIC, "When each certificate file kproxy loaded expires (its earliest "
                              "notAfter, seconds since the epoch).", labels=["file"])
        for path, when in sorted(self.snapshot().items()):
            g.add_metric([path], when)
        return [g]


# The process's certificates: one kproxy process serves one configuration.
CERTIFICATES = CertificateExpiry()
