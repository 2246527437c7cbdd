"""The traffic log: one JSON line per completed request (``traffic_line``, pure) and the writer that
puts them in hourly partitions on disk (``TrafficLogWriter``, a worker thread).

The line's format is fixed by ``traffic_log.schema.json`` beside this file; the PySpark report reads
it. The data path only puts a dict on a bounded queue and never waits: when the queue is full the line
is dropped and counted. Record keys and values, SASL bytes and other secrets never reach a line (only
batch-header facts and names do).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import queue
import shutil
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kproxy.config import TrafficLogConfig
from kproxy.protocol.errors import error_name
from kproxy.telemetry.exchange import Exchange

log = logging.getLogger("kproxy.telemetry")

SCHEMA_PATH = Path(__file__).with_name("traffic_log.schema.json")
# What readers take: finished files only. A file being written carries IN_PROGRESS after .jsonl.
FINISHED_SUFFIXES = (".jsonl", ".jsonl.gz")
IN_PROGRESS = ".part"


_second: tuple[int, str] = (-1, "")   # the last whole second formatted (one tuple: swapped atomically)


def rfc3339(epoch_s: float) -> str:
    """RFC 3339 UTC with microseconds; the date and time part is formatted once per second."""
    global _second
    whole = int(epoch_s // 1)
    micros = round((epoch_s - whole) * 1e6)
    if micros >= 1_000_000:
        whole, micros = whole + 1, micros - 1_000_000
    cached = _second
    if cached[0] != whole:
        cached = _second = (whole, datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{cached[1]}.{micros:06d}Z"


def _ms(value: float | None) -> float | None:
    return None if value is None else round(max(value, 0.0), 3)


def _hostport(hp: tuple[str, int] | None) -> str | None:
    if hp is None:
        return None
    host, port = hp
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def traffic_line(x: Exchange, epoch_offset: float, proxy: str | None = None) -> dict[str, Any]:
    """The traffic log line of one completed request. ``epoch_offset`` turns the entry's clock
    (trio's, in seconds) into seconds since the epoch."""
    e, ctx = x.entry, x.ctx
    duration, queued, broker, ret = x.split_ms()
    top, nested = x.errors
    notes = e.notes or {}
    line: dict[str, Any] = {
        "ts": rfc3339(e.started + epoch_offset),
        "conn": ctx.connection_id,
        "proxy": proxy,
        "virtual_cluster": x.virtual_cluster,
        "client_address": _hostport(ctx.client_address),
        "client_id": ctx.client_id,
        "principal": ctx.principal,
        "client_software_name": ctx.client_software_name,
        "client_software_version": ctx.client_software_version,
        "listener": ctx.listener,
        "api": x.api,
        "api_key": e.api_key,
        "api_version": e.api_version,
        "correlation_id": e.client_correlation_id,
        "broker": _hostport(e.broker),
        "outcome": e.outcome,
        "request_bytes": e.request_bytes,
        "response_bytes": e.response_bytes,
        "duration_ms": _ms(duration),
        "queued_ms": _ms(queued),
        "broker_ms": _ms(broker),
        "return_ms": _ms(ret),
        "throttle_ms": max(int(e.throttle_ms or 0), 0),
        "error_code": top,
        "error": x.error,
        "partition_errors": {error_name(code): n for code, n in nested.items()},
        "rule": notes.get("rule"),
        "action": notes.get("action"),
        "quota": _quota(notes.get("quota")),
        "records_refused": _records_refused(notes.get("records_refused")),
        "group": x.group,
        "transactional_id": x.transactional_id,
        "topics": x.topics,
    }
    if e.api_key in (0, 1):
        line["acks"] = x.acks
        line["max_wait_ms"] = x.max_wait_ms
        line["partitions"] = [p.as_dict() for p in x.partitions]
    return line


def _records_refused(refused: Any) -> list[dict[str, Any]] | None:
    if not refused:
        return None
    return [{"rule": str(r.get("rule")), "topic": r.get("topic"), "partition": int(r.get("partition", -1)),
             "records": int(r.get("records", 0))} for r in refused]


def _quota(q: Any) -> dict[str, Any] | None:
    if not isinstance(q, dict):
        return None
    return {"rule": str(q.get("rule", "")), "key": str(q.get("key", "")),
            "throttle_ms": max(int(q.get("throttle_ms", 0) or 0), 0)}


def proxy_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class TrafficLogWriter:
    """Writes lines from a bounded queue in a worker thread, into ``dir/dt=YYYY-MM-DD/hour=HH/``.

    A file is finished (renamed to ``.jsonl``, or compressed to ``.jsonl.gz``) when the UTC hour
    changes, when it reaches ``rotate_bytes``, after ``rotate_s`` seconds, and at ``close()``.
    """

    WARN_EVERY_S = 10.0

    def __init__(self, cfg: TrafficLogConfig, *, clock: Any = time.time) -> None:
        assert cfg.dir is not None
        self.cfg = cfg
        self.root = Path(cfg.dir)
        self._clock = clock
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(cfg.queue_size)
        self.written = 0
        self.dropped = 0
        self.files = 0            # files finished
        self.write_errors = 0
        self._dropped_at_warning = 0
        self._warned_at = float("-inf")
        self._file: Any = None
        self._path: Path | None = None
        self._hour: tuple[str, str] | None = None
        self._opened_at = 0.0
        self._size = 0
        self._seq = 0
        self._stem = f"kproxy-{socket.gethostname()}-{os.getpid()}"
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="kproxy-traffic-log", daemon=True)
        self._thread.start()

    # -- the data path side

    def offer(self, line: dict[str, Any]) -> bool:
        """Queue ``line`` without waiting; False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(line)
            return True
        except queue.Full:
            self.dropped += 1
            now = time.monotonic()
            if now - self._warned_at >= self.WARN_EVERY_S:
                log.warning("traffic log queue full (traffic_log.queue_size = %d): dropped %d lines so far "
                            "(%d since the last warning); the disk under %s is not keeping up",
                            self.cfg.queue_size, self.dropped, self.dropped - self._dropped_at_warning,
                            self.root)
                self._warned_at = now
                self._dropped_at_warning = self.dropped
            return False

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, finish the open file, stop the thread."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("traffic log: the queue did not drain in %gs at shutdown", timeout)
        self._thread.join(timeout)
        self._thread = None

    # -- the worker thread

    def _run(self) -> None:
        q = self._queue
        while True:
            try:
                line = q.get(timeout=1.0)
            except queue.Empty:
                self._idle()
                continue
            if line is None:
                break
            self._write(line)
            if q.empty():
                self._idle()
        self._finish()

    def _idle(self) -> None:
        f = self._file
        if f is None:
            return
        try:
            f.flush()
        except OSError as e:
            self._failed(e)
            return
        now = self._clock()
        if self._partition(now) != self._hour or now - self._opened_at >= self.cfg.rotate_s:
            self._finish()

    def _write(self, line: dict[str, Any]) -> None:
        try:
            data = (json.dumps(line, separators=(",", ":"), ensure_ascii=False, default=str) + "\n").encode()
        except (TypeError, ValueError) as e:  # a bug in the line builder; never a reason to stop
            log.error("traffic log: cannot encode a line: %s", e)
            self.dropped += 1
            return
        now = self._clock()
        hour = self._partition(now)
        if self._file is not None and (hour != self._hour or now - self._opened_at >= self.cfg.rotate_s
                                       or self._size + len(data) > self.cfg.rotate_bytes):
            self._finish()
        try:
            if self._file is None:
                self._open(hour, now)
            self._file.write(data)
        except OSError as e:
            self._failed(e)
            self.dropped += 1
            return
        self._size += len(data)
        self.written += 1

    @staticmethod
    def _partition(now: float) -> tuple[str, str]:
        t = datetime.fromtimestamp(now, UTC)
        return f"{t:%Y-%m-%d}", f"{t:%H}"

    def _open(self, hour: tuple[str, str], now: float) -> None:
        d = self.root / f"dt={hour[0]}" / f"hour={hour[1]}"
        d.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%S")
        self._path = d / f"{self._stem}-{stamp}-{self._seq:04d}.jsonl{IN_PROGRESS}"
        self._file = open(self._path, "wb")  # noqa: SIM115 - held open across calls, closed in _finish
        self._hour = hour
        self._opened_at = now
        self._size = 0

    def _finish(self) -> None:
        f, path = self._file, self._path
        self._file = self._path = None
        if f is None or path is None:
            return
        try:
            f.close()
            done = path.with_name(path.name[: -len(IN_PROGRESS)])
            if self.cfg.compression == "gzip":
                tmp = done.with_name(done.name + ".gz" + IN_PROGRESS)
                with open(path, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                tmp.rename(done.with_name(done.name + ".gz"))
                path.unlink()
            else:
                path.rename(done)
            self.files += 1
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        self.write_errors += 1
        now = time.monotonic()
        if now - self._warned_at >= self.WARN_EVERY_S:
            self._warned_at = now
            log.error("traffic log: cannot write under %s: %s", self.root, e.strerror or e)
