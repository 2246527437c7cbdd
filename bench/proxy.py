"""End-to-end proxy throughput and latency: direct to the broker, through kproxy, through peer relays.

Run from the repository root:  ``.venv/bin/python bench/proxy.py [--rounds 5] [--quick]``
(also ``--samples N``, ``--targets direct,kproxy``, ``--no-latency``, ``--profile-kproxy FILE.prof``;
``--telemetry`` adds kproxy with telemetry on, see TELEMETRY; ``--virtual-clusters`` kproxy configured
with virtual_clusters, see VIRTUAL; ``--rules`` adds kproxy with the example
multi-tenant rules, see TENANT; ``--quotas`` kproxy with rule files, see QUOTAS; ``--fleet`` the same
quota with fleet coordination on, see FLEET; ``--sasl`` kproxy logging in to the brokers by SCRAM, see
SASL).

tansu brokers (memory storage) serve the run; kproxy (``python -m kproxy run``, its own
process, log level WARNING) and ``tansu proxy`` sit in front of it. confluent-kafka (librdkafka)
produces N records with acks=all to a fresh topic and then consumes exactly those N records from the
beginning (assign, no group), through each target in turn; cases interleave, the order of the targets
rotates each round, and figures are medians over rounds. A Metadata v12 round trip on one open raw
socket per target (kproxy's own codec) gives p50/p99 latency and what each proxy adds.

``--broker fake`` replaces tansu with bench/fake_broker.py, a stand-in for a broker serving Fetch from
its page cache (1 MiB answers of prebuilt batches, as fast as loopback allows), and adds the
``haproxy`` target: HAProxy in TCP mode with ``option splice-auto`` (Debian's ``haproxy``, installed
when missing), a relay that copies nothing through user space, in front of the broker's second
listener, which advertises HAProxy's address so clients stay on the relay after bootstrap.

``--targets ...,kafka-proxy`` adds grepplabs kafka-proxy (Go), which decodes and rewrites Metadata
answers as kproxy does, in front of the same tansu: give the path of a binary built beside the project
with ``--kafka-proxy-bin PATH`` (or ``KAFKA_PROXY_BIN``). Nothing of it is part of this repository.

On tansu, ``--targets ...,haproxy`` adds the same HAProxy in front of a tansu (memory storage, the
same settings) that advertises HAProxy's port: tansu has a single listener, so the broker the other
targets use cannot also send clients to the relay. haproxy/direct is the floor of a relay that decodes
nothing. Every other relay target (kproxy and its variants, kafka-proxy) also has an identical tansu
of its own, so that no target pays for the state another left in a shared broker (``--shared-broker``
puts them all behind direct's, as before); ``tansu-proxy`` and the SASL targets keep theirs as
described. Targets run one after another, so only one broker is busy at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import confluent_kafka
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kproxy.protocol import Request, decode_response, encode_request_frame
from kproxy.protocol.messages import body_class
from kproxy.tansu import Tansu, broker_answers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from small_requests import KINDS as SMALL_KINDS
from small_requests import LoadResult, run_load

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
TARGETS = ("direct", "kproxy", "tansu-proxy")
FAKE_TARGETS = ("direct", "kproxy", "haproxy")    # the defaults with --broker fake
HAPROXY = "haproxy"
# grepplabs kafka-proxy (Go), from a binary given with --kafka-proxy-bin or KAFKA_PROXY_BIN.
KAFKA_PROXY = "kafka-proxy"
# kproxy from another source tree (--baseline DIR), e.g. the commit before a change, in the same run.
BASELINE = "kproxy-base"
# kproxy with telemetry on, each compared with plain kproxy in the same run: metrics (the admin
# listener) and the traffic log; tracing alone at 1% and at 100% sampling, exporting OTLP over HTTP
# to a receiver in this process that reads and discards the payloads.
TELEMETRY: dict[str, dict] = {
    "kp-metrics-log": {"admin": True, "traffic_log": True},
    "kp-trace-1%": {"tracing": 0.01},
    "kp-trace-100%": {"tracing": 1.0},
}
# kproxy with the example multi-tenant rules (rules/multi-tenant.yaml), compared with plain kproxy:
# its clients are tenant team-a, so every topic name is prefixed on the way in and unprefixed on the
# way out. The broker holds the tenant's topics under the prefix.
TENANT = "kproxy-tenant"
TENANT_RULES = REPO / "rules" / "multi-tenant.yaml"
TENANT_CLIENT_ID, TENANT_PREFIX = "team-a-bench", "tenant-a."
# kproxy with rule files, compared with plain kproxy and with each other in the same run: no rules
# and no quotas (the policy filter with nothing to do), and a quota that matches the bench client
# with limits it never reaches, so every request is charged to its budgets and none is throttled.
QUOTAS: dict[str, dict] = {
    "kp-rules": {"rules": "default: allow\nrules: []\n"},
    "kp-quotas": {"rules": "default: allow\nrules: []\nquotas:\n  - name: never\n"
                           "    match: {client_id: kproxy-bench}\n    produce_bytes_per_s: 1.0e12\n"
                           "    fetch_bytes_per_s: 1.0e12\n    requests_per_s: 1.0e9\n"},
}
# The same never-triggering quota with fleet coordination on (--fleet): kp-fleet/kp-quotas is what
# coordination costs the data path (target at least 0.97x).
FLEET: dict[str, dict] = {"kp-fleet": {**QUOTAS["kp-quotas"], "coordination": "{fleet: bench, topic: __kproxy_bench_quotas}",
                      "admin": True}}
# kproxy with SASL origination (upstream.sasl, SCRAM-SHA-512) against kproxy without it, both in front
# of the tests' SASL gate (tests/e2e/sasl_gate.py, which verifies the SCRAM login for real) and a
# second tansu that advertises the gate: the gate's relay is the same for both, so the ratio is what
# logging in costs. Origination adds nothing per request; the login is once per broker connection.
SASL = ("kp-gate", "kp-sasl")
# kproxy splicing streamed record batch bodies broker -> client (cut_through_splice, off by default),
# against kproxy copying them through its receive buffer, in the same run (--splice).
SPLICE: dict[str, dict] = {"kp-splice": {"settings": "cut_through_splice: true"}}
# kproxy with the lane turned off (lane: off), against kproxy with it (the default), in the same run
# (--lane): what handing steady connections to the lane's thread saves per request.
LANE: dict[str, dict] = {"kp-lane-off": {"settings": "lane: off"}}
# kproxy configured with virtual_clusters (--virtual-clusters), against plain kproxy (the single-cluster
# form, one implicit virtual cluster) in the same run: kp-vc1 with one virtual cluster, kp-vc2 with a
# second one in the same process, in front of the same broker on ports of its own and idle while the
# first carries the traffic. A virtual cluster is configuration and wiring, so both should be 1.00x
# within noise.
VIRTUAL: dict[str, dict] = {"kp-vc1": {"virtual_clusters": 1}, "kp-vc2": {"virtual_clusters": 2}}
SASL_USER, SASL_PASSWORD = "svc-bench", "bench-Secret-1"
ALL_TARGETS = (*TARGETS, HAPROXY, KAFKA_PROXY, BASELINE, *TELEMETRY, *VIRTUAL, TENANT, *QUOTAS, *FLEET, *SASL, *SPLICE, *LANE)
SIZES = (100, 1024)
# Records per run, chosen so a direct run takes about 1-3 s on the 2-core machines this was written on.
DEFAULT_N = {100: 1_500_000, 1024: 450_000}
QUICK_N = {100: 20_000, 1024: 5_000}
RUN_TIMEOUT_S = 120.0
_I32 = struct.Struct(">i")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A port P with P and P+1 both free: kproxy's bootstrap and its first broker port."""
    for _ in range(100):
        p = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind((HOST, p))
                b.bind((HOST, p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two adjacent free ports found")


def _die_with_parent() -> None:
    # Between fork and exec: PR_SET_PDEATHSIG(SIGKILL), so even a SIGKILLed bench leaves no child.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def _proc_cpu(pid: int) -> tuple[float, float, int]:
    """(own user + system CPU seconds, reaped children's, parent pid) of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[1] is ppid (field 4); utime, stime, cutime, cstime are fields 14-17.
    own = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    reaped = (int(fields[13]) + int(fields[14])) / _CLK_TCK
    return own, reaped, int(fields[1])


def _tree_cpu(root: int) -> float:
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            own, reaped, ppid = _proc_cpu(int(entry))
        except (OSError, ValueError, IndexError):
            continue                 # gone meanwhile
        parents[int(entry)] = ppid
        cpu[int(entry)] = own + reaped
    total = 0.0
    for pid, c in cpu.items():
        p = pid
        while p and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += c
    return total


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None
    started: float = 0.0

    def start(self, ready_ports: list[int], timeout: float = 20.0) -> None:
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, env=self.env)
        deadline = time.monotonic() + timeout
        for port in ready_ports:
            while not broker_answers(HOST, port):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not ready on port {port} in {timeout}s:\n{self.log_tail()}")
                time.sleep(0.05)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process so far (all threads), from /proc."""
        assert self.proc is not None
        return _proc_cpu(self.proc.pid)[0]

    def tree_cpu_seconds(self) -> float:
        """CPU time of the process and every live descendant (kproxy's worker processes), plus what
        reaped children used."""
        assert self.proc is not None
        return _tree_cpu(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class OtlpSink:
    """An OTLP/HTTP endpoint that reads each export and answers 200, counting the payloads."""

    def __init__(self) -> None:
        import http.server
        import threading

        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sink.bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
                sink.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.requests = 0
        self.bytes = 0
        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.endpoint = f"http://{HOST}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------------------------
# Throughput


@dataclass
class RunResult:
    seconds: float
    proxy_cpu: float | None  # proxy CPU seconds / wall seconds (1.0 = one core busy)


def create_topic(admin: AdminClient, topic: str) -> None:
    # Partition 1 takes the producer's warm-up record, so its connections exist before the clock
    # starts; partition 0 holds exactly the N timed records.
    fut = admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic]
    fut.result(timeout=30)


def delete_topic(admin: AdminClient, topic: str) -> None:
    with contextlib.suppress(Exception):  # best effort: it only frees the broker's memory
        admin.delete_topics([topic])[topic].result(timeout=30)


def produce(bootstrap: str, topic: str, n: int, value: bytes, client_id: str = "kproxy-bench") -> float:
    """Seconds to produce n records to partition 0 with acks=all and have them all acknowledged."""
    errors: list[str] = []
    acked = 0

    def on_delivery(err: object, _msg: object) -> None:
        nonlocal acked
        if err is not None:
            errors.append(str(err))
        else:
            acked += 1

    p = Producer({
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "acks": "all",
        # A queue large enough for every record, so enqueueing never blocks on BufferError;
        # batching and linger stay at librdkafka's defaults (1 MB batches, linger.ms=5).
        "queue.buffering.max.messages": max(100_000, n + 1),
        "queue.buffering.max.kbytes": 2_097_151,
    })
    p.produce(topic, b"warm-up", partition=1)
    if p.flush(30) != 0:
        raise RuntimeError(f"warm-up record to {bootstrap} not acknowledged")
    produce_ = p.produce
    poll = p.poll
    t0 = time.perf_counter()
    for i in range(n):
        try:
            produce_(topic, value, partition=0, on_delivery=on_delivery)
        except BufferError:
            poll(0.005)
            produce_(topic, value, partition=0, on_delivery=on_delivery)
        if i & 0x3FF == 0:
            poll(0)
    left = p.flush(RUN_TIMEOUT_S)
    dt = time.perf_counter() - t0
    if left or errors or acked != n:
        raise RuntimeError(f"produce via {bootstrap}: {acked}/{n} acked, {left} left, errors {errors[:3]}")
    return dt


def consume(bootstrap: str, topic: str, n: int, size: int, client_id: str = "kproxy-bench") -> float:
    """Seconds to read exactly n records of partition 0 from the beginning (assign, no group)."""
    c = Consumer({
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "group.id": f"kproxy-bench-{uuid.uuid4().hex[:8]}",  # required by the client; never joined
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        # tansu answers a Fetch with ~5 MB whatever max.partition.fetch.bytes says, so librdkafka's
        # default local queue (100,000 messages) overflows and it backs off for a whole second
        # (fetch.queue.backoff.ms); a queue that holds the whole run measures the pipe instead.
        "queued.min.messages": max(100_000, 2 * n),
        "queued.max.messages.kbytes": 2_097_151,
    })
    try:
        # Metadata first, so the partition's leader is known when it is assigned; offset 0 is the
        # beginning of this fresh topic and spares a ListOffsets round trip in the timed part.
        c.list_topics(topic, timeout=30)
        got = 0
        last = None
        consume_ = c.consume
        deadline = time.monotonic() + RUN_TIMEOUT_S
        t0 = time.perf_counter()
        c.assign([TopicPartition(topic, 0, 0)])
        while got < n:
            # consume() waits for all it asks for (or the timeout): never ask past the last record.
            msgs = consume_(min(10_000, n - got), 0.5)
            for m in msgs:
                if m.error():
                    raise KafkaException(m.error())
            if msgs:
                got += len(msgs)
                last = msgs[-1]
            elif time.monotonic() > deadline:
                break
        dt = time.perf_counter() - t0
    finally:
        c.close()
    if got != n or last is None or last.offset() != n - 1 or len(last.value() or b"") != size:
        raise RuntimeError(f"consume via {bootstrap}: read {got} of {n} records "
                           f"(last offset {last.offset() if last else None})")
    return dt


# ---------------------------------------------------------------------------------------------
# Metadata latency


class MetadataProbe:
    """One open connection sending Metadata v12 (no topics) and timing each round trip."""

    def __init__(self, port: int, client_id: str = "kproxy-bench") -> None:
        self.client_id = client_id
        self.sock = socket.create_connection((HOST, port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 16)
        self.cid = 0
        self.samples: list[float] = []

    def once(self, keep: bool = True) -> None:
        self.cid += 1
        req = Request.build(3, 12, self.cid, self.client_id, body_class(3, "request")(topics=[]))
        frame = b"".join(bytes(b) for b in encode_request_frame(req))
        sock, buf = self.sock, self.buf
        t0 = time.perf_counter_ns()
        sock.sendall(frame)
        have = 0
        size = -1
        while size < 0 or have < 4 + size:
            k = sock.recv_into(memoryview(buf)[have:])
            if k == 0:
                raise ConnectionError("connection closed during a Metadata round trip")
            have += k
            if size < 0 and have >= 4:
                (size,) = _I32.unpack_from(buf, 0)
                if 4 + size > len(buf):
                    raise RuntimeError(f"Metadata response of {size} bytes is larger than expected")
        dt = time.perf_counter_ns() - t0
        if have != 4 + size:
            raise RuntimeError("bytes after the Metadata response on a strict request/response socket")
        resp = decode_response(memoryview(buf)[4 : 4 + size], 3, 12)
        if resp.correlation_id != self.cid or not resp.body.brokers:
            raise RuntimeError(f"bad Metadata response: {resp!r}")
        if keep:
            self.samples.append(dt / 1e6)

    def close(self) -> None:
        self.sock.close()


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Bench:
    args: argparse.Namespace
    workdir: Path
    children: list[Child] = field(default_factory=list)
    otlp: OtlpSink | None = None
    ports: dict[str, int] = field(default_factory=dict)
    proxies: dict[str, Child] = field(default_factory=dict)
    admin_ports: dict[str, int] = field(default_factory=dict)

    def start(self) -> None:
        if self.args.broker == "fake":
            self._start_fake()
            return
        launcher = Tansu(port=free_port())          # kproxy's launcher gives the command line
        tansu, bp = launcher.binary, launcher.port
        url = f"tcp://{HOST}:{bp}"
        # A Child rather than the launcher itself, so the broker's CPU time is measured like the others'.
        broker = Child("tansu broker", launcher.argv(), self.workdir / "broker.log")
        self.children.append(broker)
        broker.start([bp])
        self.broker = broker
        self.ports["direct"] = bp
        self.admins: dict[str, AdminClient] = {}

        if "kproxy" in self.args.targets:
            self._start_kproxy(self._broker_for("kproxy", bp))
        if BASELINE in self.args.targets:
            self._start_kproxy(self._broker_for(BASELINE, bp), BASELINE)
        for name, options in {**TELEMETRY, **VIRTUAL, **QUOTAS, **FLEET, **SPLICE, **LANE}.items():
            if name in self.args.targets:
                self._start_kproxy(self._broker_for(name, bp), name, options)
        if TENANT in self.args.targets:
            self._start_kproxy(self._broker_for(TENANT, bp), TENANT, extra=["--rules", str(TENANT_RULES)])
        if "tansu-proxy" in self.args.targets:
            self._start_tansu_proxy(tansu, url)
        if KAFKA_PROXY in self.args.targets:
            self._start_kafka_proxy(self._broker_for(KAFKA_PROXY, bp))
        self.admin = AdminClient({"bootstrap.servers": f"{HOST}:{bp}"})
        if set(SASL) & set(self.args.targets):
            self._start_gate()
        if HAPROXY in self.args.targets:
            self._start_relay_tansu()

    def _broker_for(self, name: str, shared: int) -> int:
        """The port of the tansu behind target ``name``: one of its own, started with the same
        settings as direct's, unless ``--shared-broker``. One tansu serving several targets can charge
        each for the others' leftovers (its memory storage costs more per Produce as a partition
        fills; topics and connections other targets left). With a broker each, what differs between
        targets is only what the relay in front does to the broker's work."""
        if self.args.shared_broker:
            return shared
        launcher = Tansu(port=free_port())
        broker = Child(f"tansu broker ({name})", launcher.argv(), self.workdir / f"broker-{name}.log")
        self.children.append(broker)
        broker.start([launcher.port])
        # Topics are made and deleted on the target's own broker, directly (it advertises itself).
        self.admins[name] = AdminClient({"bootstrap.servers": f"{HOST}:{launcher.port}"})
        return launcher.port

    def _start_gate(self) -> None:
        sys.path.insert(0, str(REPO))
        from tests.e2e.sasl_gate import SaslGate, free_ports

        (gate_port,) = free_ports(1)
        launcher = Tansu(port=free_port(), advertised=(HOST, gate_port))
        broker = Child("tansu broker (gate)", launcher.argv(), self.workdir / "broker-gate.log")
        self.children.append(broker)
        broker.start([launcher.port])
        gate = SaslGate((HOST, launcher.port), {SASL_USER: SASL_PASSWORD}, port=gate_port).start()
        gate.require_sasl = False        # kp-gate does not log in; kp-sasl does, and is verified
        self.gate = gate
        password = self.workdir / "password"
        password.write_text(SASL_PASSWORD)
        for name in SASL:
            if name not in self.args.targets:
                continue
            options: dict = {"upstream": gate.bootstrap}
            if name == "kp-sasl":
                options["sasl"] = (f"{{mechanism: SCRAM-SHA-512, username: {SASL_USER}, "
                                   f"password_file: \"{password}\"}}")
            self._start_kproxy(launcher.port, name, options)
            self.admins[name] = AdminClient({"bootstrap.servers": f"{HOST}:{self.ports[name]}"})

    def _start_relay_tansu(self) -> None:
        """HAProxy on tansu: a second tansu, with the same settings as the first, that advertises
        HAProxy's port, and HAProxy in front of it. tansu has one listener, so a broker advertising
        the relay cannot serve the other targets, whose clients must stay on their own path."""
        hp = free_port()
        launcher = Tansu(port=free_port(), advertised=(HOST, hp))
        broker = Child("tansu broker (haproxy)", launcher.argv(), self.workdir / "broker-haproxy.log")
        self.children.append(broker)
        broker.start([launcher.port])
        self._start_haproxy(hp, launcher.port)
        # Through the relay, like the clients: the broker's metadata names HAProxy's port anyway.
        self.admins[HAPROXY] = AdminClient({"bootstrap.servers": f"{HOST}:{hp}"})

    def _start_fake(self) -> None:
        """The fake page-cache broker: one listener for direct clients and kproxy, a second that
        advertises HAProxy's port, and HAProxy in front of it."""
        bp, relay_side, hp = free_port(), free_port(), free_port()
        argv = [sys.executable, str(REPO / "bench" / "fake_broker.py"), "--listen", f"{HOST}:{bp}",
                "--listen", f"{HOST}:{relay_side}={HOST}:{hp}"]
        broker = Child("fake broker", argv, self.workdir / "broker.log")
        self.children.append(broker)
        broker.start([bp, relay_side])
        self.broker = broker
        self.ports["direct"] = bp
        for name, options in {**TELEMETRY, **VIRTUAL, **QUOTAS, **SPLICE, **LANE}.items():
            if name in self.args.targets:
                self._start_kproxy(bp, name, options)
        if "kproxy" in self.args.targets:
            self._start_kproxy(bp)
        if BASELINE in self.args.targets:
            self._start_kproxy(bp, BASELINE)
        if HAPROXY in self.args.targets:
            self._start_haproxy(hp, relay_side)
        self.admin = AdminClient({"bootstrap.servers": f"{HOST}:{bp}"})
        self.admins = {}

    def _start_haproxy(self, port: int, upstream: int) -> None:
        binary = haproxy_binary()
        cfg = self.workdir / "haproxy.cfg"
        # TCP mode, splice(2) between the sockets whenever the kernel allows (splice-auto): no byte
        # crosses user space. Thread count is HAProxy's default (one per CPU).
        cfg.write_text("\n".join([
            "global", "    maxconn 4000", "defaults", "    mode tcp", "    option splice-auto",
            "    timeout connect 5s", "    timeout client 1h", "    timeout server 1h",
            "frontend kafka", f"    bind {HOST}:{port}", "    default_backend broker",
            "backend broker", f"    server broker {HOST}:{upstream}", ""]))
        child = Child(HAPROXY, [binary, "-db", "-f", str(cfg)], self.workdir / "haproxy.log")
        self.children.append(child)
        child.start([port])
        self.ports[HAPROXY] = port
        self.proxies[HAPROXY] = child

    def _start_kproxy(self, bp: int, name: str = "kproxy", telemetry: dict | None = None,
                      extra: list[str] | None = None) -> None:
        kp = free_port_pair()
        kargv = [sys.executable]
        if self.args.profile_kproxy and name == "kproxy":
            kargv += ["-m", "cProfile", "-o", str(self.args.profile_kproxy)]
        env = None
        if name == BASELINE:
            # The other tree's kproxy package comes first on the path (an editable install's
            # finder only answers what the path does not). PYTHONSAFEPATH: without it ``-m``
            # puts the working directory (this repository) first, and kproxy-base ran this tree.
            env = {**os.environ, "PYTHONPATH": str(self.args.baseline), "PYTHONSAFEPATH": "1"}
        if telemetry is None:
            kargv += ["-m", "kproxy", "run", "--upstream", f"{HOST}:{bp}", "--listen", f"{HOST}:{kp}",
                      "--log-level", "WARNING", *(extra or [])]
        else:
            kargv += ["-m", "kproxy", "run", "--config", str(self._config_file(name, telemetry, bp, kp))]
            if "tracing" in telemetry:
                env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": self._otlp_receiver(),
                       "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
        kproxy = Child(name, kargv, self.workdir / f"{name}.log", env=env)
        self.children.append(kproxy)
        kproxy.start([kp, kp + 1])  # bootstrap, then the broker port it opened at discovery
        self.ports[name] = kp
        self.proxies[name] = kproxy

    def _config_file(self, name: str, telemetry: dict, bp: int, kp: int) -> Path:
        if "virtual_clusters" in telemetry:
            return self._clusters_file(name, telemetry["virtual_clusters"], bp, kp)
        upstream = telemetry.get("upstream", f"{HOST}:{bp}")
        sasl = f", sasl: {telemetry['sasl']}" if "sasl" in telemetry else ""
        lines = [f'listen: "{HOST}:{kp}"', f'upstream: {{bootstrap_servers: "{upstream}"{sasl}}}', "log_level: WARNING"]
        if "rules" in telemetry:
            rules = self.workdir / f"{name}-rules.yaml"
            rules.write_text(telemetry["rules"])
            lines.append(f'rules: ["{rules}"]')
        if "settings" in telemetry:
            lines.append(telemetry["settings"])
        if "coordination" in telemetry:
            lines.append(f"quota: {{coordination: {telemetry['coordination']}}}")
        if telemetry.get("admin"):
            self.admin_ports[name] = free_port()
            lines.append(f'admin: {{listen: "{HOST}:{self.admin_ports[name]}"}}')
        if telemetry.get("traffic_log"):
            lines.append(f'traffic_log: {{dir: "{self.workdir / name}-traffic"}}')
        if "tracing" in telemetry:
            lines.append(f"tracing: {{enabled: true, sample_ratio: {telemetry['tracing']}}}")
        path = self.workdir / f"{name}.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _clusters_file(self, name: str, clusters: int, bp: int, kp: int) -> Path:
        """kproxy as ``virtual_clusters``: the bench's on ``kp`` (its broker on ``kp + 1``, as plain
        kproxy's), and ``clusters - 1`` idle ones in front of the same broker on ports of their own."""
        lines = ["virtual_clusters:"]
        for i in range(clusters):
            port = kp if i == 0 else free_port_pair()
            lines += [f"  - name: vc-{i}", f'    listen: "{HOST}:{port}"',
                      f'    upstream: {{bootstrap_servers: "{HOST}:{bp}"}}',
                      f"    exposure: {{broker_port_start: {port + 1}, broker_port_count: 1}}"]
        lines.append("log_level: WARNING")
        path = self.workdir / f"{name}.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _otlp_receiver(self) -> str:
        if self.otlp is None:
            self.otlp = OtlpSink()
        return self.otlp.endpoint

    def _start_tansu_proxy(self, tansu: str, url: str) -> None:
        tp = free_port()
        turl = f"tcp://{HOST}:{tp}"
        tproxy = Child("tansu proxy", [tansu, "proxy", "--listener-url", turl, "--advertised-listener-url",
                                       turl, "--origin-url", url], self.workdir / "tansu-proxy.log")
        self.children.append(tproxy)
        tproxy.start([tp])
        self.ports["tansu-proxy"] = tp
        self.proxies["tansu-proxy"] = tproxy

    def _start_kafka_proxy(self, bp: int) -> None:
        """grepplabs kafka-proxy in front of the broker: the bootstrap mapping sends the broker's own
        address (the only one tansu advertises) to kafka-proxy's listener, so Metadata answers name
        kafka-proxy and clients stay on it. Dynamic listeners (its default) would serve other brokers."""
        lp, http = free_port(), free_port()
        argv = [str(self.args.kafka_proxy_bin), "server",
                "--bootstrap-server-mapping", f"{HOST}:{bp},{HOST}:{lp}",
                "--default-listener-ip", HOST, "--http-listen-address", f"{HOST}:{http}",
                "--log-level", "warning"]
        child = Child(KAFKA_PROXY, argv, self.workdir / "kafka-proxy.log")
        self.children.append(child)
        child.start([lp])
        self.ports[KAFKA_PROXY] = lp
        self.proxies[KAFKA_PROXY] = child

    def stop(self) -> None:
        # The admin client keeps a broker connection; drop it first so it does not log the shutdown.
        self.__dict__.pop("admin", None)
        self.__dict__.pop("admins", None)
        gc.collect()
        for child in reversed(self.children):
            # SIGINT lets a cProfile'd kproxy drain and write its profile; SIGTERM for the rest.
            sig = signal.SIGINT if child.name == "kproxy" else signal.SIGTERM
            with contextlib.suppress(Exception):
                child.stop(sig)
        if self.otlp is not None:
            self.otlp.stop()
        gate = self.__dict__.pop("gate", None)
        if gate is not None:
            gate.close()

    def coordination_figures(self) -> str:
        """kp-fleet's coordination traffic over its whole life, from its /metrics."""
        import urllib.request

        with urllib.request.urlopen(f"http://{HOST}:{self.admin_ports['kp-fleet']}/metrics", timeout=5) as r:
            text = r.read().decode()
        got = {}
        for line in text.splitlines():
            if line.startswith("kproxy_quota_coordination_") and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                got[name] = float(value)
        seconds = time.monotonic() - self.proxies["kp-fleet"].started
        out = got.get('kproxy_quota_coordination_bytes_total{direction="out"}', 0.0)
        into = got.get('kproxy_quota_coordination_bytes_total{direction="in"}', 0.0)
        return (f"kp-fleet coordination: up={got.get('kproxy_quota_coordination_up')}, "
                f"{out / seconds / 1000:.2f} KB/s out and {into / seconds / 1000:.2f} KB/s in over {seconds:.0f} s "
                f"(one budget active)")

    def check_alive(self) -> None:
        for child in self.children:
            if not child.alive():
                raise RuntimeError(f"{child.name} died:\n{child.log_tail()}")

    def one_run(self, target: str, size: int, n: int, value: bytes) -> tuple[RunResult, RunResult]:
        bootstrap = f"{HOST}:{self.ports[target]}"
        topic = f"bench-{target.replace('%', 'pct')}-{size}-{uuid.uuid4().hex[:8]}"
        # A tenant's topic is created directly under the name the broker holds for it.
        held = TENANT_PREFIX + topic if target == TENANT else topic
        client_id = TENANT_CLIENT_ID if target == TENANT else "kproxy-bench"
        admin = self.admins.get(target, self.admin)
        create_topic(admin, held)
        proxy = self.proxies.get(target)
        try:
            results = []
            for step in (lambda: produce(bootstrap, topic, n, value, client_id),
                         lambda: consume(bootstrap, topic, n, size, client_id)):
                cpu0 = proxy.cpu_seconds() if proxy else 0.0
                dt = step()
                cpu = (proxy.cpu_seconds() - cpu0) / dt if proxy else None
                results.append(RunResult(dt, cpu))
            return results[0], results[1]
        finally:
            delete_topic(admin, held)

    def throughput(self, rounds: int, ns: dict[int, int]) -> dict[tuple[str, int, str], list[RunResult]]:
        out: dict[tuple[str, int, str], list[RunResult]] = {}
        values = {size: os.urandom(size) for size in ns}
        targets = self.args.targets
        for r in range(rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            for size in ns:
                for target in order:
                    self.check_alive()
                    p, c = self.one_run(target, size, ns[size], values[size])
                    out.setdefault(("produce", size, target), []).append(p)
                    out.setdefault(("consume", size, target), []).append(c)
                    print(f"  round {r + 1}/{rounds}  {size:>5} B  {target:<15} "
                          f"produce {ns[size] / p.seconds:>10,.0f} rec/s   "
                          f"consume {ns[size] / c.seconds:>10,.0f} rec/s", file=sys.stderr, flush=True)
        return out

    def small_requests(self, rounds: int, clients: int, seconds: float,
                       kinds: tuple[str, ...] = ("metadata",)) -> dict[str, dict[str, list[tuple[LoadResult, float | None]]]]:
        """Many connections looping on small requests (bench/small_requests.py: Metadata v12, or a
        one-record Produce with acks=1), per kind, target and round; with each proxy's CPU seconds per
        request (its whole process tree: kproxy's workers too)."""
        out: dict[str, dict[str, list[tuple[LoadResult, float | None]]]] = {}
        targets = [t for t in self.args.targets if t in SMALL_TARGETS]
        for r in range(rounds):
            for kind in kinds:
                for target in targets[r % len(targets):] + targets[: r % len(targets)]:
                    self.check_alive()
                    proxy = self.proxies.get(target)
                    # Each produce run writes to a topic of its own, made just before it and deleted
                    # after it, so that every run starts on an empty partition: tansu's memory storage
                    # costs more per Produce as a partition fills, and the targets do not share one
                    # broker (HAProxy's has only HAProxy's records), so a shared topic would charge
                    # the targets on the first broker for each other's records.
                    admin = self.admins.get(target, self.admin)
                    topic = f"small-{kind}-{uuid.uuid4().hex[:8]}" if kind.startswith("produce") else None
                    if topic:
                        create_topic(admin, topic)
                    cpu0 = proxy.tree_cpu_seconds() if proxy else 0.0
                    res = run_load(f"{HOST}:{self.ports[target]}", clients, seconds, warmup=1.0, kind=kind,
                                   topic=topic)
                    cpu = (proxy.tree_cpu_seconds() - cpu0) / res.answers_total if proxy else None
                    if topic:
                        delete_topic(admin, topic)
                    out.setdefault(kind, {}).setdefault(target, []).append((res, cpu))
                    print(f"  round {r + 1}/{rounds}  {clients} clients  {kind:<9}{target:<15} "
                          f"{res.requests_per_s:>10,.0f} req/s  p99 {res.p99_ms:.1f} ms"
                          + (f"  {cpu * 1e6:.0f} us CPU/request" if cpu is not None else ""),
                          file=sys.stderr, flush=True)
        return out

    def latency(self, samples: int, block: int = 100) -> dict[str, list[float]]:
        targets = self.args.targets
        probes = {t: MetadataProbe(self.ports[t], TENANT_CLIENT_ID if t == TENANT else "kproxy-bench")
                  for t in targets}
        try:
            for p in probes.values():
                for _ in range(100):
                    p.once(keep=False)  # warm-up: caches, branch predictors, the proxy's codecs
            i = 0
            while min(len(p.samples) for p in probes.values()) < samples:
                # Blocks of round trips, target order rotating, so drift in the machine spreads evenly.
                order = targets[i % len(targets):] + targets[: i % len(targets)]
                for t in order:
                    for _ in range(min(block, samples - len(probes[t].samples))):
                        probes[t].once()
                i += 1
            return {t: p.samples for t, p in probes.items()}
        finally:
            for p in probes.values():
                p.close()


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


# Targets of the small-request loops (bench/small_requests.py).
SMALL_TARGETS = ("direct", "kproxy", "tansu-proxy", HAPROXY, KAFKA_PROXY, BASELINE, *VIRTUAL, *LANE)

RATIOS = (("kproxy", "direct"), ("tansu-proxy", "direct"), ("kproxy", "tansu-proxy"),
          (HAPROXY, "direct"), ("kproxy", HAPROXY), ("tansu-proxy", HAPROXY),
          (KAFKA_PROXY, "direct"), ("kproxy", KAFKA_PROXY), (KAFKA_PROXY, HAPROXY), ("kproxy", BASELINE), (BASELINE, HAPROXY),
          *((name, "kproxy") for name in TELEMETRY), *((name, "kproxy") for name in VIRTUAL), (TENANT, "kproxy"), ("kp-quotas", "kproxy"),
          ("kp-quotas", "kp-rules"), ("kp-fleet", "kp-quotas"), ("kp-sasl", "kp-gate"),
          ("kp-splice", "kproxy"), ("kp-splice", HAPROXY), ("kproxy", "kp-lane-off"), ("kp-lane-off", HAPROXY))


def report_throughput(ns: dict[int, int], tp: dict[tuple[str, int, str], list[RunResult]],
                      targets: tuple[str, ...]) -> None:
    rounds = len(next(iter(tp.values())))
    print("records per run: " + ", ".join(f"{ns[s]:,} x {s} B" for s in ns)
          + f"; {rounds} interleaved round(s); MB/s = records x value size / 1e6")
    print("proxy CPU = the proxy process's CPU time / wall time of the run (100% = one core); "
          "mcores/MBps = millicores of proxy CPU per MB/s moved; CPU s/GB = proxy CPU seconds per GB moved")
    print()
    hdr = (f"{'case':<16}{'target':<15}{'median rec/s':>13}{'MB/s':>8}{'min-max rec/s':>24}"
           f"{'proxy CPU':>11}{'mcores/MBps':>13}{'CPU s/GB':>10}")
    print(hdr)
    print("-" * len(hdr))
    med: dict[tuple[str, int, str], float] = {}
    for op in ("produce", "consume"):
        for size in ns:
            for target in targets:
                runs = tp[(op, size, target)]
                rates = [ns[size] / r.seconds for r in runs]
                m = statistics.median(rates)
                med[(op, size, target)] = m
                cpus = [r.proxy_cpu for r in runs if r.proxy_cpu is not None]
                cpu = f"{statistics.median(cpus) * 100:.0f}%" if cpus else "-"
                mbps = m * size / 1e6
                # CPU fraction per MB/s is millicores per MB/s / 1000, and also CPU seconds per MB.
                per = statistics.median(cpus) / mbps if cpus and mbps else None
                mcores = f"{per * 1000:.1f}" if per is not None else "-"
                per_gb = f"{per * 1000:.1f}" if per is not None else "-"
                case = f"{op} {size} B" if target == targets[0] else ""
                print(f"{case:<16}{target:<15}{m:>13,.0f}{mbps:>8.1f}"
                      f"{f'{min(rates):,.0f}-{max(rates):,.0f}':>24}{cpu:>11}{mcores:>13}{per_gb:>10}")
    pairs = [(a, b) for a, b in RATIOS if a in targets and b in targets]
    if not pairs:
        return
    print()
    print("Ratios of records/s: of the medians above, and (paired) the median of each round's own ratio")
    hdr = f"{'case':<16}" + "".join(f"{f'{a}/{b}':>26}" for a, b in pairs)
    print(hdr)
    print(f"{'':<16}" + "".join(f"{'medians   paired':>26}" for _ in pairs))
    print("-" * len(hdr))
    for op in ("produce", "consume"):
        for size in ns:
            cells = []
            for a, b in pairs:
                paired = statistics.median(rb.seconds / ra.seconds
                                           for ra, rb in zip(tp[(op, size, a)], tp[(op, size, b)], strict=True))
                cells.append(f"{fmt_ratio(med[(op, size, a)], med[(op, size, b)]):>16}{paired:>9.2f}x")
            print(f"{f'{op} {size} B':<16}" + "".join(f"{c:>26}" for c in cells))


SMALL_WHAT = {"metadata": "Metadata v12 (no topics)",
              "produce": "Produce v9, acks=1, one 100-byte record"}


def report_small_requests(by_kind: dict[str, dict[str, list[tuple[LoadResult, float | None]]]], clients: int) -> None:
    first = True
    for kind, res in by_kind.items():
        if not first:
            print()
        first = False
        rounds = len(next(iter(res.values())))
        print(f"Many small requests: {clients} connections each looping on {SMALL_WHAT[kind]}, one request in "
              f"flight per connection; {rounds} interleaved round(s), medians (min-max)")
        # Against HAProxy (the floor of a relay that decodes nothing) and kafka-proxy when they ran.
        floors = [f for f in ("direct", HAPROXY, KAFKA_PROXY) if f in res]
        hdr = (f"{'target':<15}{'requests/s':>12}{'min-max':>18}" + "".join(f"{f'/ {f}':>15}" for f in floors)
               + f"{'p50 ms':>9}{'p99 ms':>9}{'CPU/request':>13}{'min-max':>12}{'/ HAProxy':>11}")
        print(hdr)
        print("-" * len(hdr))
        base = {f: statistics.median(r.requests_per_s for r, _ in res[f]) for f in floors}
        cpu_h = [c for _, c in res.get(HAPROXY, []) if c is not None]
        cpu_base = statistics.median(cpu_h) if cpu_h else None
        for target, runs in res.items():
            rates = [r.requests_per_s for r, _ in runs]
            rate = statistics.median(rates)
            cpus = [c for _, c in runs if c is not None]
            cpu = f"{statistics.median(cpus) * 1e6:.0f} us" if cpus else "-"
            spread = f"{min(cpus) * 1e6:.0f}-{max(cpus) * 1e6:.0f}" if cpus else "-"
            vs_h = f"{statistics.median(cpus) / cpu_base:.2f}x" if cpus and cpu_base else "-"
            print(f"{target:<15}{rate:>12,.0f}{f'{min(rates):,.0f}-{max(rates):,.0f}':>18}"
                  + "".join(f"{rate / base[f]:>14.2f}x" for f in floors)
                  + f"{statistics.median(r.p50_ms for r, _ in runs):>9.2f}"
                  f"{statistics.median(r.p99_ms for r, _ in runs):>9.2f}{cpu:>13}{spread:>12}{vs_h:>11}")
        pairs = [(a, b) for a, b in (("kproxy", HAPROXY), ("kproxy", KAFKA_PROXY), ("kproxy", BASELINE),
                                     (KAFKA_PROXY, HAPROXY)) if a in res and b in res]
        if pairs:
            print("paired (each round's own ratio of requests/s, median and min-max): " + "; ".join(
                f"{a}/{b} {_paired(res[a], res[b])}" for a, b in pairs))


def _paired(a: list[tuple[LoadResult, float | None]], b: list[tuple[LoadResult, float | None]]) -> str:
    ratios = [ra.requests_per_s / rb.requests_per_s for (ra, _), (rb, _) in zip(a, b, strict=True)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def report_latency(lat: dict[str, list[float]], targets: tuple[str, ...]) -> None:
    n = min(len(v) for v in lat.values())
    print(f"Metadata v12 round trip (no topics) on one open connection, {n:,} samples per target, ms")
    hdr = f"{'target':<15}{'p50':>8}{'p99':>8}{'added p50':>11}{'added p99':>11}"
    print(hdr)
    print("-" * len(hdr))
    d50, d99 = percentile(lat["direct"], 50), percentile(lat["direct"], 99)
    for t in targets:
        p50, p99 = percentile(lat[t], 50), percentile(lat[t], 99)
        a50 = f"{p50 - d50:+.3f}" if t != "direct" else "-"
        a99 = f"{p99 - d99:+.3f}" if t != "direct" else "-"
        print(f"{t:<15}{p50:>8.3f}{p99:>8.3f}{a50:>11}{a99:>11}")


def haproxy_binary() -> str:
    """HAProxy from Debian, installed with apt-get when missing and this is root."""
    found = shutil.which("haproxy") or (Path("/usr/sbin/haproxy").is_file() and "/usr/sbin/haproxy")
    if not found and os.geteuid() == 0 and shutil.which("apt-get"):
        print("  installing haproxy (Debian) for the haproxy target", file=sys.stderr, flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "haproxy"],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        found = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not found:
        raise RuntimeError("haproxy is not installed (Debian package haproxy; `make bench-deps` installs it)")
    return str(found)


def _interrupt(signum: int, _frame: object) -> None:
    # SIGTERM takes the same way out as Ctrl-C, so the finally in main() stops every child.
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, small N, 300 latency samples")
    ap.add_argument("--samples", type=int, default=2000, help="Metadata round trips per target (default 2000)")
    ap.add_argument("--records-100", type=int, help=f"records per 100 B run (default {DEFAULT_N[100]:,})")
    ap.add_argument("--records-1k", type=int, help=f"records per 1 KiB run (default {DEFAULT_N[1024]:,})")
    ap.add_argument("--broker", choices=("tansu", "fake"), default="tansu",
                    help="tansu, or bench/fake_broker.py (a page-cache broker; its default targets include haproxy)")
    ap.add_argument("--targets", default=None,
                    help=f"comma-separated subset of {','.join(ALL_TARGETS).replace('%', '%%')} (direct is always run)")
    ap.add_argument("--telemetry", action="store_true",
                    help=f"add {', '.join(TELEMETRY).replace('%', '%%')} (and kproxy, which they are compared with)")
    ap.add_argument("--virtual-clusters", action="store_true",
                    help=f"add {', '.join(VIRTUAL)}: kproxy configured with one and two virtual clusters (and "
                         "kproxy, the single-cluster form they are compared with)")
    ap.add_argument("--rules", action="store_true",
                    help=f"add {TENANT}, kproxy with rules/multi-tenant.yaml (and kproxy, which it is compared with)")
    ap.add_argument("--quotas", action="store_true",
                    help=f"add {', '.join(QUOTAS)} (and kproxy, which they are compared with)")
    ap.add_argument("--baseline", metavar="DIR", type=Path,
                    help=f"add {BASELINE}: kproxy run from the source tree DIR (DIR/kproxy), e.g. "
                         "`git archive COMMIT kproxy | tar -x -C DIR` plus the built kproxy/protocol/_accel*.so")
    ap.add_argument("--fleet", action="store_true",
                    help=f"add {', '.join(FLEET)} (and kp-quotas, which it is compared with)")
    ap.add_argument("--sasl", action="store_true",
                    help=f"add {', '.join(SASL)}: kproxy through a SASL gate, logging in by SCRAM or not")
    ap.add_argument("--splice", action="store_true",
                    help=f"add {', '.join(SPLICE)}: kproxy splicing record bodies (and kproxy, which it is compared with)")
    ap.add_argument("--lane", action="store_true",
                    help=f"add {', '.join(LANE)}: kproxy without the lane (and kproxy, with it, which it is compared with)")
    ap.add_argument("--no-latency", action="store_true", help="skip the Metadata latency part")
    ap.add_argument("--small-clients", type=int, default=200,
                    help="connections in the many-small-requests part (default 200; 0 skips it)")
    ap.add_argument("--small-seconds", type=float, default=5.0, help="seconds per small-requests run")
    ap.add_argument("--small-kinds", default="metadata,produce",
                    help="small-request loops: metadata, produce (one 100-byte record, acks=1) or both (default)")
    ap.add_argument("--shared-broker", action="store_true",
                    help="on tansu, one broker behind direct, kproxy and kafka-proxy (and their variants) rather "
                         "than an identical broker of its own for each")
    ap.add_argument("--no-throughput", action="store_true", help="skip the throughput part")
    ap.add_argument("--kafka-proxy-bin", metavar="PATH", type=Path, default=os.environ.get("KAFKA_PROXY_BIN"),
                    help=f"the grepplabs kafka-proxy binary for the {KAFKA_PROXY} target (default: $KAFKA_PROXY_BIN)")
    ap.add_argument("--profile-kproxy", metavar="FILE.prof",
                    help="run kproxy under cProfile and write its profile here (slows kproxy down)")
    args = ap.parse_args(argv)
    fake = args.broker == "fake"
    if args.targets is None:
        args.targets = ",".join(FAKE_TARGETS if fake else TARGETS)
    wanted = set(args.targets.split(",")) | {"direct"}
    if args.telemetry:
        wanted |= {"kproxy", *TELEMETRY}
    if args.virtual_clusters:
        wanted |= {"kproxy", *VIRTUAL}
    if args.rules:
        wanted |= {"kproxy", TENANT}
    if args.quotas:
        wanted |= {"kproxy", *QUOTAS}
    if args.baseline is not None:
        if not (args.baseline / "kproxy" / "__init__.py").is_file():
            ap.error(f"--baseline {args.baseline}: no kproxy package there")
        args.baseline = args.baseline.resolve()
        wanted |= {"kproxy", BASELINE}
    elif BASELINE in wanted:
        ap.error(f"{BASELINE} needs --baseline DIR")
    if args.fleet:
        wanted |= {"kp-quotas", *FLEET}
    if args.sasl:
        wanted |= set(SASL)
    if args.splice:
        wanted |= {"kproxy", *SPLICE}
    if args.lane:
        wanted |= {"kproxy", *LANE}
    if wanted - set(ALL_TARGETS):
        ap.error(f"unknown targets: {', '.join(sorted(wanted - set(ALL_TARGETS)))}")
    if KAFKA_PROXY in wanted:
        if args.kafka_proxy_bin is None:
            ap.error(f"{KAFKA_PROXY} needs --kafka-proxy-bin PATH (or KAFKA_PROXY_BIN): a grepplabs kafka-proxy "
                     "binary built beside the project")
        args.kafka_proxy_bin = Path(args.kafka_proxy_bin).resolve()
        if not os.access(args.kafka_proxy_bin, os.X_OK):
            ap.error(f"--kafka-proxy-bin {args.kafka_proxy_bin}: not an executable file")
    if set(args.small_kinds.split(",")) - set(SMALL_KINDS):
        ap.error(f"--small-kinds: one or more of {', '.join(SMALL_KINDS)}")
    if fake and wanted & {"tansu-proxy", KAFKA_PROXY, TENANT, *FLEET, *SASL}:
        ap.error(f"{', '.join(sorted(wanted & {'tansu-proxy', TENANT, *FLEET, *SASL}))} need --broker tansu")
    args.targets = tuple(t for t in ALL_TARGETS if t in wanted)
    rounds, samples = (1, 300) if args.quick else (args.rounds, args.samples)
    ns = dict(QUICK_N if args.quick else DEFAULT_N)
    if args.records_100:
        ns[100] = args.records_100
    if args.records_1k:
        ns[1024] = args.records_1k
    if fake:
        # The fake broker's batches are of the first record's size; 1 KiB is the case the goals name.
        ns = {1024: ns[1024]}
    if args.profile_kproxy:
        args.profile_kproxy = Path(args.profile_kproxy).resolve()

    # Ctrl-C anywhere (also while blocked in librdkafka) must still reach the finally below.
    signal.signal(signal.SIGTERM, _interrupt)
    with tempfile.TemporaryDirectory(prefix="kproxy-bench-") as tmp:
        bench = Bench(args, Path(tmp))
        try:
            load_before = _load()
            bench.start()
            print("  " + "  ".join(f"{t} :{p}" for t, p in bench.ports.items()), file=sys.stderr, flush=True)
            tp = {} if args.no_throughput else bench.throughput(rounds, ns)
            lat = None if args.no_latency else bench.latency(samples)
            small = (bench.small_requests(rounds, args.small_clients, 2.0 if args.quick else args.small_seconds,
                                          tuple(args.small_kinds.split(",")))
                     if args.small_clients else None)
            bench.check_alive()
            fleet = bench.coordination_figures() if "kp-fleet" in args.targets else None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        finally:
            bench.stop()
    print()
    print(f"confluent-kafka {confluent_kafka.__version__} (librdkafka {confluent_kafka.libversion()[0]}), "
          f"{'fake page-cache broker' if fake else 'tansu broker (memory storage)'}"
          f"{'' if fake or HAPROXY not in args.targets else ' (haproxy: a second, identical tansu behind it)'}, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}; "
          f"{load_before} before, {_load()} after")
    if tp:
        report_throughput(ns, tp, args.targets)
    if fleet:
        print()
        print(fleet)
    if lat:
        print()
        report_latency(lat, args.targets)
    if small:
        print()
        report_small_requests(small, args.small_clients)
    if bench.otlp is not None:
        print(f"\nOTLP receiver: {bench.otlp.requests} exports, {bench.otlp.bytes / 1e6:.1f} MB of spans")
    if args.profile_kproxy:
        print(f"\nkproxy profile written to {args.profile_kproxy}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
