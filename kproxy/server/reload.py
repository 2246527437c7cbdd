"""Live reload of rule files: poll what the files look like, reload when that changes.

Polling once a second is simple and right for the way Kubernetes updates a ConfigMap volume (the
visible names are symlinks through ``..data``, and an update swaps that one symlink): each poll
stats the configured names afresh, following symlinks, and lists the directories. No inotify, so it
works the same on every filesystem, volume and editor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable

import trio

from kproxy.policy.loader import rule_files
from kproxy.policy.store import RuleStore

log = logging.getLogger("kproxy.server")

POLL_INTERVAL_S = 1.0

Fingerprint = tuple[tuple[str, tuple[int, int, int, int] | None], ...]


def _stat(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)      # follows symlinks: a swapped ..data gives a new inode
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def fingerprint(paths: tuple[str, ...]) -> Fingerprint:
    """What the rule files look like now: each configured path and each file it stands for, with
    its device, inode, modification time and size (None when it cannot be read)."""
    seen = [(path, _stat(path)) for path in paths]
    seen += [(file, _stat(file)) for file in rule_files(paths)]
    return tuple(seen)


async def watch_rules(store: RuleStore, interval: float = POLL_INTERVAL_S,
                      reload: Callable[[str], Awaitable[object]] | None = None) -> None:
    """Reload ``store`` whenever its files change (through ``reload`` when given: the server's,
    which checks the KEKs of encrypt rules first); runs until cancelled."""
    last = fingerprint(store.paths)
    while True:
        await trio.sleep(interval)
        now = fingerprint(store.paths)
        if now != last:
            last = now
            if reload is not None:
                await reload("a rule file changed")
            else:
                store.reload("a rule file changed")
