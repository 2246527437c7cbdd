"""TLS contexts that follow their certificate, key and CA files on disk (cert-manager and SPIFFE
rotate them every few hours).

A ``ReloadingContext`` is the one ``ssl.SSLContext`` the listeners and broker connections hold; each
new connection is handed to the context most recently loaded from the files, so a rotation needs no
change anywhere else, and connections already open keep the certificates they began with. The files
are polled by content, like the rule files (``reload.py``): a swapped ``..data`` symlink, an editor's
rename or an in-place write all show. A file that does not load keeps the old context in force.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import ssl
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import trio

log = logging.getLogger("kproxy.server")

POLL_INTERVAL_S = 5.0

Fingerprint = tuple[tuple[str, str | None], ...]


def fingerprint(files: Iterable[str]) -> Fingerprint:
    """Each file with a digest of what it holds now (None when it cannot be read)."""
    out = []
    for path in files:
        try:
            with open(path, "rb") as f:
                digest: str | None = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            digest = None
        out.append((path, digest))
    return tuple(out)


class ReloadingContext(ssl.SSLContext):
    """The context of one side (``setting`` is ``tls`` or ``upstream.tls``), rebuilt by ``build`` from
    ``files`` when they change. Only ``wrap_bio``/``wrap_socket`` are used on it (trio and the stdlib
    call nothing else when opening a connection), and both go to ``current``."""

    current: ssl.SSLContext

    def __new__(cls, setting: str, files: Sequence[str], build: Callable[[], ssl.SSLContext],
                server_side: bool, on_loaded: Callable[[], None] | None = None) -> ReloadingContext:
        return super().__new__(cls, ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)

    def __init__(self, setting: str, files: Sequence[str], build: Callable[[], ssl.SSLContext],
                 server_side: bool, on_loaded: Callable[[], None] | None = None) -> None:
        """Loads the files now; errors propagate (at start-up a file that does not load is fatal).
        ``on_loaded`` runs after every successful load, the first included (certificate expiry)."""
        self.setting = setting
        self.files = tuple(dict.fromkeys(files))
        self._build = build
        self._on_loaded = on_loaded
        self.reloads_ok = 0
        self.reloads_failed = 0
        self._seen = fingerprint(self.files)
        self.current = build()
        self.loaded_at = datetime.datetime.now(datetime.UTC)
        if on_loaded is not None:
            on_loaded()

    def wrap_bio(self, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, server_side: bool = False,
                 server_hostname: Any = None, session: Any = None) -> ssl.SSLObject:
        return self.current.wrap_bio(incoming, outgoing, server_side, server_hostname, session)

    def wrap_socket(self, sock: Any, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        return self.current.wrap_socket(sock, *args, **kwargs)

    def check(self) -> bool:
        """Reload when the files changed since the last look; True when a new context took over."""
        now = fingerprint(self.files)
        if now == self._seen:
            return False
        self._seen = now
        missing = [path for path, digest in now if digest is None]
        try:
            if missing:
                raise OSError(f"cannot read {', '.join(missing)}")
            fresh = self._build()
        except (OSError, ssl.SSLError, ValueError) as e:
            self.reloads_failed += 1
            log.error("%s: the certificate files changed but do not load (%s); new handshakes keep using "
                      "the files loaded at %s", self.setting, _reason(e), self.loaded_at.isoformat(timespec="seconds"))
            return False
        self.current = fresh
        self.loaded_at = datetime.datetime.now(datetime.UTC)
        self.reloads_ok += 1
        log.info("%s: reloaded %s; new handshakes use them, open connections keep theirs",
                 self.setting, ", ".join(self.files))
        if self._on_loaded is not None:
            self._on_loaded()
        return True


def _reason(e: BaseException) -> str:
    if isinstance(e, ssl.SSLError):
        return f"{e.reason or e}" + (f" in {e.library}" if e.library else "")
    return str(e)


async def watch_tls(contexts: Sequence[ReloadingContext], interval: float = POLL_INTERVAL_S) -> None:
    """Poll each context's files every ``interval`` seconds; runs until cancelled."""
    while True:
        await trio.sleep(interval)
        for ctx in contexts:
            ctx.check()
