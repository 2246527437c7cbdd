"""``workers: N``: N kproxy processes sharing the listening ports (SO_REUSEPORT), and the supervisor
that starts them, restarts one that dies, drains them on SIGTERM and serves their merged metrics.

Each worker is ``kproxy run`` with the same arguments, told by the environment which worker it is
(``KPROXY_WORKER=i/n``) and where its private admin listener is (``KPROXY_WORKER_ADMIN``). The kernel
spreads new connections over the workers; a connection lives in one worker. Workers agree on the
broker ports because the ports are deterministic (``exposure.node_id_base``, or SNI on one port),
which the config requires when ``workers`` is more than one. Budgets (the buffer budget, quotas) are
divided among the workers as among replicas.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import trio

from kproxy.config import ProxyConfig, effective_workers
from kproxy.server import admin
from kproxy.server.app import SIGNALS, SUPERVISOR_ENV
from kproxy.server.clients import MAX_LISTED

log = logging.getLogger("kproxy.supervisor")

WORKER_ENV = "KPROXY_WORKER"                # "i/n": this process is worker i of n
WORKER_ADMIN_ENV = "KPROXY_WORKER_ADMIN"    # host:port of this worker's private admin listener
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
PROBE_BUDGET_S = 1.5        # all workers asked at once, for /readyz
SCRAPE_BUDGET_S = 5.0       # for /metrics, /config and /rules
SWITCH_BUDGET_S = 120.0     # for POST /switch (drain, catch-up and offset translation in every worker)
# Gauges that are states or times, not amounts: the workers' values are not added up. The earliest
# certificate expiry and "ready only if every worker is" (min); the latest rule load, the longest lag,
# "a reload failing in any worker", and the rule count every worker has (max).
MERGED_BY = {
    "kproxy_tls_certificate_expiry_timestamp_seconds": min,
    "kproxy_ready": min,
    "kproxy_event_loop_lag_max_seconds": max,
    "kproxy_rules": max,
    "kproxy_rules_generation": max,
    "kproxy_rules_loaded_timestamp_seconds": max,
    "kproxy_tls_loaded_timestamp_seconds": max,
    "kproxy_rules_reload_failing": max,
    # Every worker reads the same file on the same SIGHUP: the most any worker has waiting.
    "kproxy_settings_restart_pending": max,
    # Upstream clusters: a worker still on the old cluster shows as 1 too until it follows; a
    # cluster is reachable only if every worker's probe reached it.
    "kproxy_upstream_active": max,
    "kproxy_upstream_reachable": min,
    "kproxy_upstream_switch_hold_seconds": max,
}


def worker_identity(environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """(index, count) when this process is a worker; None otherwise."""
    value = (environ if environ is not None else os.environ).get(WORKER_ENV)
    if not value:
        return None
    index, _, count = value.partition("/")
    return int(index), int(count)


class Worker:
    def __init__(self, index: int, count: int, argv: Sequence[str], admin_address: str | None) -> None:
        self.index = index
        self.count = count
        self.argv = list(argv)
        self.admin_address = admin_address
        self.process: trio.Process | None = None
        self.restarts = 0

    async def start(self) -> None:
        env = dict(os.environ)
        env[WORKER_ENV] = f"{self.index}/{self.count}"
        env[SUPERVISOR_ENV] = str(os.getpid())
        if self.admin_address is not None:
            env[WORKER_ADMIN_ENV] = self.admin_address
        # Its own session: a terminal's Ctrl-C reaches only the supervisor, which passes it on once (a
        # worker that got it twice would stop at once instead of draining). A worker whose supervisor
        # was killed outright notices and stops by itself (PR_SET_PDEATHSIG cannot be used: trio
        # starts processes from a worker thread, and the signal follows that thread, not the process).
        # It starts with SIGNALS blocked: one passed on before it handles them (it is importing, or
        # reading its settings) stays pending until serve_until_signal unblocks it, instead of ending
        # the worker outright, without a drain or its last log line.
        self.process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "kproxy", *self.argv], env=env, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_hold_signals)
        log.info("worker %d started (pid %d)", self.index, self.process.pid)

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signum)


class Supervisor:
    """Starts the workers and keeps them running until a signal says otherwise."""

    def __init__(self, config: ProxyConfig, argv: Sequence[str]) -> None:
        self.config = config
        self.count = effective_workers(config)
        self.stopping = False
        self.workers = [Worker(i, self.count, argv, _private_address() if config.admin.listen else None)
                        for i in range(self.count)]

    async def run(self) -> int:
        # Signals are the supervisor's before the first worker starts: one that arrives meanwhile is
        # passed on once they all are started (each holds it until it handles signals), instead of
        # ending the supervisor and orphaning them.
        with trio.open_signal_receiver(*SIGNALS) as signals:
            async with trio.open_nursery() as nursery:
                for w in self.workers:
                    await w.start()
                    nursery.start_soon(self._watch, w)
                if self.config.admin.listen is not None:
                    listener = admin.bind(self.config.admin.listen)
                    merged = SupervisorAdmin(self, listener)
                    nursery.start_soon(merged.serve)
                    log.info("admin listener on %s: merged /metrics and /clients of %d workers, /livez /readyz "
                             "/config /rules", self.config.admin.listen, self.count)
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if signum != signal.SIGHUP:
                        log.info("%s: %s the %d workers", name,
                                 "stopping" if self.stopping else "draining", self.count)
                        self.stopping = True
                    for w in self.workers:
                        w.signal(signum)
                    if self.stopping and all(w.process is None or w.process.returncode is not None
                                             for w in self.workers):
                        break
                    if self.stopping:
                        nursery.start_soon(self._wait_all_then_cancel, nursery.cancel_scope)
        log.info("kproxy stopped (%d workers)", self.count)
        return 0

    async def _wait_all_then_cancel(self, scope: trio.CancelScope) -> None:
        for w in self.workers:
            if w.process is not None:
                await w.process.wait()
        scope.cancel()

    async def _watch(self, w: Worker) -> None:
        while True:
            assert w.process is not None
            code = await w.process.wait()
            if self.stopping:
                log.info("worker %d exited (%d)", w.index, code)
                return
            delay = RESTART_BACKOFF_S[min(w.restarts, len(RESTART_BACKOFF_S) - 1)]
            log.error("worker %d exited unexpectedly with %d; restarting it in %gs", w.index, code, delay)
            w.restarts += 1
            await trio.sleep(delay)
            if self.stopping:
                return
            await w.start()


class SupervisorAdmin(admin.AdminServer):
    """The public admin listener of a supervisor: what the workers' private listeners say, merged."""

    def __init__(self, supervisor: Supervisor, listener: trio.SocketListener) -> None:
        super().__init__(None, listener)  # type: ignore[arg-type]   # answers are not read off one server
        self.supervisor = supervisor

    async def answer(self, method: str, target: str) -> tuple[int, str, bytes]:
        path = target.split("?", 1)[0]
        workers = self.supervisor.workers
        if path == "/switch" and method == "POST":
            return await self._switch(target)
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"only GET and HEAD (and POST /switch)\n"
        if path == "/livez":
            dead = [w.index for w in workers if w.process is None or w.process.returncode is not None]
            if dead:
                return 503, "text/plain; charset=utf-8", f"workers not running: {dead}\n".encode()
            return 200, "text/plain; charset=utf-8", b"ok\n"
        # Probes (a kubelet's default timeout is 1 s, the shipped chart allows 2 s) get the workers'
        # answers within PROBE_BUDGET_S; a scrape may wait longer.
        budget = PROBE_BUDGET_S if path == "/readyz" else SCRAPE_BUDGET_S
        answers = await fetch_all([w.admin_address for w in workers], target, budget)
        if path == "/metrics":
            texts = [body for status, _, body in answers if status == 200]
            if not texts:
                return 503, "text/plain; charset=utf-8", b"no worker answered\n"
            # The process group's own families: no virtual cluster (an empty label, as in each worker).
            running = sum(1 for w in workers if w.process and w.process.returncode is None)
            extra = (f"# HELP kproxy_workers Worker processes running.\n# TYPE kproxy_workers gauge\n"
                     f'kproxy_workers{{virtual_cluster=""}} {running}\n'
                     "# HELP kproxy_workers_scraped Workers whose metrics are in this answer (the others did "
                     "not answer in time).\n# TYPE kproxy_workers_scraped gauge\n"
                     f'kproxy_workers_scraped{{virtual_cluster=""}} {len(texts)}\n'
                     "# HELP kproxy_worker_restarts_total Workers restarted after exiting unexpectedly.\n"
                     "# TYPE kproxy_worker_restarts_total counter\n"
                     f'kproxy_worker_restarts_total{{virtual_cluster=""}} {sum(w.restarts for w in workers)}\n'
                     ).encode()
            return 200, admin.PROMETHEUS_TEXT, merge_expositions(texts) + extra
        if path == "/clients":
            views = []
            for w, (status, _, body) in zip(workers, answers, strict=True):
                if status == 200:
                    try:
                        views.append((w.index, json.loads(body)))
                    except ValueError:
                        log.warning("worker %d answered /clients with something that is not JSON", w.index)
            if not views:
                return 503, "text/plain; charset=utf-8", b"no worker answered\n"
            return 200, "application/json", (json.dumps(merge_clients(views), indent=2) + "\n").encode()
        if path == "/readyz":
            not_ready = [f"worker {w.index}: {body.decode(errors='replace').strip() or status}"
                         for w, (status, _, body) in zip(workers, answers, strict=True) if status != 200]
            if not_ready:
                return 503, "text/plain; charset=utf-8", ("; ".join(not_ready) + "\n").encode()
            return 200, "text/plain; charset=utf-8", f"ready ({len(workers)} workers)\n".encode()
        # /config, /rules and /upstream are the same in every worker: worker 0's answer.
        return answers[0]

    async def _switch(self, target: str) -> tuple[int, str, bytes]:
        """Every worker switches (each drains its own connections); the answer is theirs, by worker.
        A worker that did not answer still follows the switch through the state file."""
        workers = self.supervisor.workers
        answers = await fetch_all([w.admin_address for w in workers], target, SWITCH_BUDGET_S, method="POST")
        out: dict[str, Any] = {}
        failed = []
        for w, (status, _, body) in zip(workers, answers, strict=True):
            try:
                out[str(w.index)] = json.loads(body) if status == 200 else body.decode(errors="replace").strip()
            except ValueError:
                out[str(w.index)] = body.decode(errors="replace").strip()
            if status != 200:
                failed.append(status)
        status = 200 if not failed else (failed[0] if len(failed) == len(workers) else 502)
        return status, "application/json", (json.dumps({"workers": out}, indent=2) + "\n").encode()


async def fetch_all(addresses: Sequence[str | None], target: str, timeout: float,
                    method: str = "GET") -> list[tuple[int, str, bytes]]:
    """GET (or POST) ``target`` from every worker's private admin listener at once: one (status,
    content type, body) per address, in order, all within ``timeout`` seconds."""
    answers: list[tuple[int, str, bytes]] = [(503, "text/plain; charset=utf-8", b"no answer\n")] * len(addresses)

    async def one(i: int, address: str | None) -> None:
        answers[i] = await _fetch(address, target, timeout, method)

    async with trio.open_nursery() as nursery:
        for i, address in enumerate(addresses):
            nursery.start_soon(one, i, address)
    return answers


async def _fetch(address: str | None, target: str, timeout: float, method: str = "GET") -> tuple[int, str, bytes]:
    """GET (or POST) ``target`` from a worker's private admin listener: (status, content type, body)."""
    if address is None:
        return 503, "text/plain; charset=utf-8", b"no admin listener\n"
    host, _, port = address.rpartition(":")
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                length = "Content-Length: 0\r\n" if method == "POST" else ""
                await stream.send_all(f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{length}Connection: close\r\n\r\n"
                                      .encode())
                data = bytearray()
                while chunk := await stream.receive_some(65536):
                    data += chunk
                    if len(data) > 64 * 1024 * 1024:
                        break
    except trio.TooSlowError:
        return 503, "text/plain; charset=utf-8", f"no answer within {timeout:g}s\n".encode()
    except (OSError, trio.BrokenResourceError) as e:
        return 503, "text/plain; charset=utf-8", f"worker admin unreachable: {e}\n".encode()
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return 502, "text/plain; charset=utf-8", b"bad answer from a worker\n"
    ctype = next((line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("content-type:")),
                 "text/plain; charset=utf-8")
    return status, ctype, body


# Gauges whose workers' values add up to the process group's (each worker holds its own share).
# Every other gauge is a state, a time or a worst case: MERGED_BY says min or max, and one in neither
# table merges as the largest value, never a multiple. A new gauge that is a per-process amount must
# be listed here, or the supervisor reports one worker's worth (tests/unit/test_workers.py checks
# that every gauge a worker exposes is in one of the two tables).
ADDITIVE_GAUGES = frozenset({
    "kproxy_connections_open", "kproxy_requests_in_flight", "kproxy_buffered_bytes", "kproxy_buffer_budget_bytes",
    "kproxy_remembered_answer_bytes", "kproxy_dek_cache_entries", "kproxy_kms_keys_backing_off",
    "kproxy_lane_connections", "kproxy_lane_remembered_answer_bytes",
})


def merge_expositions(texts: Sequence[bytes]) -> bytes:
    """Prometheus text expositions of several workers as one, by metric type: counters, histograms
    and summaries are added up per sample (``*_created`` timestamps take the earliest); gauges in
    ``ADDITIVE_GAUGES`` are added up, those in ``MERGED_BY`` take its min or max, any other gauge
    the largest value. Families keep their HELP and TYPE lines and the order they first appeared in."""
    families: dict[str, tuple[list[str], dict[str, float]]] = {}
    types: dict[str, str] = {}
    for text in texts:
        family = ""
        for line in text.decode().splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    meta, _ = families.setdefault(family, ([], {}))
                    if line not in meta:
                        meta.append(line)
                    if parts[1] == "TYPE" and len(parts) == 4:
                        types[family] = parts[3].strip()
                continue
            key, _, value = line.rpartition(" ")
            _, samples = families.setdefault(family, ([], {}))
            number = float(value)
            name = key.split("{", 1)[0]
            if key not in samples:
                samples[key] = number
            elif name in MERGED_BY:
                samples[key] = MERGED_BY[name](samples[key], number)
            elif name.endswith("_created"):
                samples[key] = min(samples[key], number)
            elif types.get(family) == "gauge" and family not in ADDITIVE_GAUGES:
                samples[key] = max(samples[key], number)
            else:
                samples[key] += number
    out = []
    for meta, samples in families.values():
        out.extend(meta)
        out.extend(f"{key} {_number(v)}" for key, v in samples.items())
    return ("\n".join(out) + "\n").encode()


def merge_clients(views: Sequence[tuple[int, dict]], limit: int = MAX_LISTED) -> dict:
    """The /clients answers of several workers as one; every row says its ``worker`` (connection
    numbers are per worker), and the merged lists keep the same bound and order as one worker's."""
    live: list[dict] = []
    recent: list[dict] = []
    omitted = 0
    for index, view in views:
        live += [{**row, "worker": index} for row in view.get("connections", [])]
        recent += [{**row, "worker": index} for row in view.get("recent", [])]
        omitted += int(view.get("omitted", 0))
    live.sort(key=lambda r: r.get("request_bytes", 0) + r.get("response_bytes", 0), reverse=True)
    recent.sort(key=lambda r: r.get("closed_at") or 0, reverse=True)
    omitted += max(0, len(live) - limit) + max(0, len(recent) - limit)
    return {"time": max(float(v.get("time", 0)) for _, v in views),
            "live": sum(int(v.get("live", 0)) for _, v in views),
            "connections": live[:limit], "recent": recent[:limit], "omitted": omitted}


def _number(v: float) -> str:
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def _hold_signals() -> None:
    # In the new worker between fork and exec: the signal mask survives exec (see Worker.start).
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def _private_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
