"""``kproxy demo``: the product tour on an embedded tansu broker, with kafka-python knowing only kproxy.

A rule file gives one client a tenant namespace (it sees ``orders``, the broker holds
``tenant-a.orders``), refuses a topic with the Kafka error a broker with ACLs would send, and holds a
producer to a quota, second by second, whose throttle the client itself reports; then ``/metrics``, the traffic log and,
where Java and PySpark are installed, ``kproxy report`` over that log. ``kproxy demo --plain`` is the
smaller round trip of ``kproxy.demo``, which dispatches between the two.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kproxy.demo_stage import CLIENT_TIMEOUT_MS, DemoError, embedded_broker, import_kafka, proxy_config
from kproxy.server.embedded import ProxyThread
from kproxy.tansu import HOST, free_port

TENANT_CLIENT = "tenant-a-shop"
TENANT_PREFIX = "tenant-a."
TOPIC = "orders"
DENIED_TOPIC = "secret-keys"
QUOTA_CLIENT = "bulk-loader"
QUOTA_BYTES_PER_S = 100 * 1024
RECORD = b"x" * 1024
# The quota step produces for QUOTA_SECONDS and counts what the broker acknowledged in each second.
# The first second holds the burst (burst_s, 1 s by default) and the next one pays it back; by
# STEADY_FROM_S the rate is the quota's. One 16 KiB batch in flight at a time keeps each throttle
# short (about 0.16 s), so every second shows the rate rather than a pause or a catch-up.
QUOTA_SECONDS = 7
STEADY_FROM_S = 3
QUOTA_IN_FLIGHT_BYTES = 16 * 1024
BAR_KIB = 10                        # KiB/s per '#' of the bars
STEP_TIMEOUT_S = 30.0
REPORT_TIMEOUT_S = 600.0
# Metric series worth showing, by prefix (the labels follow).
SHOWN_METRICS = ('kproxy_requests_total{api="produce",', 'kproxy_denied_requests_total{',
                 'kproxy_throttle_seconds_total{', 'kproxy_records_total{')

RULES = f"""\
# The demo's rules: read top to bottom, the first rule that matches a request (or a topic) decides.
rules:
  - name: no-secrets
    match: {{topic: "secret-*"}}
    action: deny
  - name: tenant-a
    match: {{client_id: "tenant-a-*"}}
    action: rewrite
    rewrite: {{topic_prefix: "{TENANT_PREFIX}", group_prefix: "{TENANT_PREFIX}"}}
quotas:
  - name: bulk-loader
    match: {{client_id: "{QUOTA_CLIENT}"}}
    per: client_id
    produce_bytes_per_s: {QUOTA_BYTES_PER_S}
"""


@dataclass
class TourResult:
    """What each step found, for the summary and for the tests."""

    client_topics: list[str] = field(default_factory=list)
    broker_topics: list[str] = field(default_factory=list)
    denied_error: str = ""
    quota_acked: list[int] = field(default_factory=list)   # bytes acknowledged in each second
    client_throttle_ms: float = 0.0
    metrics: list[str] = field(default_factory=list)
    log_files: list[Path] = field(default_factory=list)
    log_lines: list[dict[str, Any]] = field(default_factory=list)


def _tenant_step(kafka: Any, proxied: str, broker: str, result: TourResult) -> None:
    admin = kafka.KafkaAdminClient(bootstrap_servers=proxied, client_id=TENANT_CLIENT,
                                   request_timeout_ms=CLIENT_TIMEOUT_MS)
    try:
        admin.create_topics([kafka.admin.NewTopic(TOPIC, 1, 1)])
        result.client_topics = sorted(admin.list_topics())
    finally:
        admin.close()
    producer = kafka.KafkaProducer(bootstrap_servers=proxied, client_id=TENANT_CLIENT, acks="all",
                                   request_timeout_ms=CLIENT_TIMEOUT_MS, max_block_ms=int(STEP_TIMEOUT_S * 1000))
    try:
        for i in range(20):
            producer.send(TOPIC, key=b"order-%d" % i, value=b'{"order": %d}' % i)
        producer.flush(timeout=STEP_TIMEOUT_S)
        # kafka-python logs the refusal at ERROR before raising it; the exception is what the tour shows.
        kafka_log = logging.getLogger("kafka")
        level, kafka_log.level = kafka_log.level, logging.CRITICAL
        try:
            producer.send(DENIED_TOPIC, value=b"hunter2").get(timeout=STEP_TIMEOUT_S)
        except kafka.errors.KafkaError as e:
            result.denied_error = type(e).__name__
        finally:
            kafka_log.setLevel(level)
    finally:
        producer.close(timeout=5)
    # Straight to the broker, past kproxy: what the cluster really holds.
    direct = kafka.KafkaAdminClient(bootstrap_servers=broker, request_timeout_ms=CLIENT_TIMEOUT_MS)
    try:
        result.broker_topics = sorted(direct.list_topics())
    finally:
        direct.close()


class _Acks:
    """A producer's records in flight and when each was acknowledged; kafka-python calls back on its
    own thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.changed = threading.Condition()
        self.in_flight = 0
        self.times: list[float] = []
        self.failed: list[BaseException] = []

    def wait_for_room(self, size: int, deadline: float) -> bool:
        """Wait until ``size`` more bytes fit in flight (then count them), or until the deadline."""
        with self.changed:
            room = self.changed.wait_for(lambda: self.in_flight + size <= self.limit or bool(self.failed),
                                         timeout=max(0.0, deadline - time.perf_counter()))
            if room and not self.failed:
                self.in_flight += size
                return True
            return False

    def settled(self, size: int, error: BaseException | None) -> None:
        with self.changed:
            self.in_flight -= size
            if error is None:
                self.times.append(time.perf_counter())
            else:
                self.failed.append(error)
            self.changed.notify_all()


def _quota_step(kafka: Any, proxied: str, result: TourResult) -> None:
    """``bulk-loader`` produces as fast as kproxy lets it for QUOTA_SECONDS; the bytes acknowledged in
    each second (the rate as the client sees it) go to ``result.quota_acked``."""
    topic = f"{QUOTA_CLIENT}-load"
    producer = kafka.KafkaProducer(bootstrap_servers=proxied, client_id=QUOTA_CLIENT, acks=1, linger_ms=5,
                                   batch_size=QUOTA_IN_FLIGHT_BYTES, request_timeout_ms=CLIENT_TIMEOUT_MS,
                                   max_block_ms=int(STEP_TIMEOUT_S * 1000))
    acks = _Acks(QUOTA_IN_FLIGHT_BYTES)
    size = len(RECORD)
    try:
        producer.send(topic, value=b"warm-up").get(timeout=STEP_TIMEOUT_S)   # creates the topic
        started = time.perf_counter()
        ends = started + QUOTA_SECONDS
        while time.perf_counter() < ends and not acks.failed:
            if acks.wait_for_room(size, ends):
                future = producer.send(topic, value=RECORD)
                future.add_callback(lambda _metadata: acks.settled(size, None))
                future.add_errback(lambda error: acks.settled(size, error))
        producer.flush(timeout=STEP_TIMEOUT_S)
        for group in producer.metrics().values():
            for name, value in group.items():
                if name == "throttle-time-max" and isinstance(value, (int, float)) and value == value:
                    result.client_throttle_ms = max(result.client_throttle_ms, float(value))
    finally:
        producer.close(timeout=5)
    if acks.failed:
        raise DemoError(f"{QUOTA_CLIENT} could not produce: {acks.failed[0]!r}")
    result.quota_acked = [0] * QUOTA_SECONDS
    for when in acks.times:
        second = int(when - started)
        if second < QUOTA_SECONDS:
            result.quota_acked[second] += size


def steady_rate(acked: list[int]) -> float:
    """Bytes per second acknowledged after the burst and its payback (seconds STEADY_FROM_S on)."""
    steady = acked[STEADY_FROM_S:]
    return sum(steady) / len(steady) if steady else 0.0


def _quota_lines(result: TourResult) -> list[str]:
    kib, quota = 1024, QUOTA_BYTES_PER_S
    width = 2 * quota // kib // BAR_KIB + 1           # bars up to twice the quota, the burst's second
    lines = [f"   {QUOTA_CLIENT} produced 1 KiB records for {QUOTA_SECONDS} s, as fast as kproxy let it; "
             "KiB the broker acknowledged:",
             f"   {'second':>8}  {'KiB':>4}  {'':{width}}  average since the start"]
    total = 0
    for second, got in enumerate(result.quota_acked):
        total += got
        note = ("  (the burst)" if second == 0 and got > quota else
                "  (the burst paid back)" if second == 1 and got < quota else "")
        lines.append(f"   {f'{second}-{second + 1} s':>8}  {got // kib:4d}  {'#' * round(got / kib / BAR_KIB):{width}}  "
                     f"{total / kib / (second + 1):4.0f} KiB/s{note}")
    lines.append(f"   after the burst: {steady_rate(result.quota_acked) / kib:.0f} KiB/s "
                 f"(seconds {STEADY_FROM_S}-{QUOTA_SECONDS}); the quota is {quota // kib} KiB/s")
    return lines


def _scrape(admin_url: str) -> list[str]:
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return [line for line in text.splitlines() if line.startswith(SHOWN_METRICS) and not line.endswith(" 0.0")]


def _read_log(directory: Path, result: TourResult) -> None:
    import gzip

    result.log_files = sorted(p for p in directory.rglob("*.jsonl*") if not p.name.endswith(".part"))
    for path in result.log_files:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as lines:
            result.log_lines += [json.loads(line) for line in lines if line.strip()]


def _report_available() -> str | None:
    """None when ``kproxy report`` can run here, else what is missing."""
    if importlib.util.find_spec("pyspark") is None:
        return "PySpark is not installed (pip install 'kproxy-kafka[analytics]')"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java runtime (Java 17 or newer; Debian: apt-get install openjdk-17-jre-headless)"
    return None


# Set in the environment of the report's process, and so of its JVM: the work directory of the demo
# that started them (the tests look for processes that carry it after the demo ends).
DEMO_DIR_ENV = "KPROXY_DEMO_DIR"


class ReportProcess:
    """``kproxy report`` in its own process (``kproxy.analytics.standby``), started before the tour's
    first step so that its Spark session comes up while the steps run; ``run`` then hands it the
    traffic log. It runs in a session (process group) of its own, so a Ctrl-C reaches the tour only,
    and ``stop`` ends the group, its JVM included; should the tour die unannounced, the process sees
    its stdin close and exits, and its JVM with it."""

    def __init__(self, work: Path) -> None:
        # What it prints, Spark's warnings included, for the lines shown when it fails.
        self.log_path = work / "report.log"
        self._log = self.log_path.open("w+", encoding="utf-8")  # closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kproxy.analytics.standby", "--master", "local[2]"],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, DEMO_DIR_ENV: str(work)})

    def run(self, log_dir: Path, out: Path) -> tuple[bool, list[str]]:
        """The report over ``log_dir`` into ``out``: success, and its last lines (what went wrong)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"logs": [str(log_dir)], "out": str(out)}) + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass               # it has already ended (Spark did not start): its stderr says why
        try:
            code = self.proc.wait(timeout=REPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            return False, [f"no report after {REPORT_TIMEOUT_S:.0f} s; stopped"]
        self._log.seek(0)
        lines = [line for line in self._log.read().splitlines() if line.strip()]
        return code == 0 and (out / "report.html").is_file(), lines[-6:]

    def stop(self, grace_s: float = 5.0) -> None:
        """Ends the process and everything it started (its JVM): TERM to the group, then KILL to what
        is left after ``grace_s``. Safe to call more than once."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)   # the group outlives its leader while the JVM runs
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        self._log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _line_of(result: TourResult, **want: Any) -> dict[str, Any] | None:
    return next((line for line in result.log_lines if all(line.get(k) == v for k, v in want.items())), None)


def run_tour(out_dir: str | None, report: bool) -> int:
    wall = time.perf_counter()
    work = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="kproxy-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    rules_file, log_dir = work / "rules.yaml", work / "traffic"
    rules_file.write_text(RULES)
    print("kproxy demo: what kproxy is for, on an embedded tansu broker (kproxy demo --plain: records only)\n",
          flush=True)
    missing = _report_available() if report else "left out (--no-report)"
    # The report's Spark session starts now, in its own process, and comes up while steps 1 to 4 run.
    reporter = ReportProcess(work) if missing is None else None
    try:
        return _tour_steps(work, rules_file, log_dir, reporter, missing, wall)
    finally:
        if reporter is not None:
            reporter.stop()


def _tour_steps(work: Path, rules_file: Path, log_dir: Path, reporter: ReportProcess | None,
                missing: str | None, wall: float) -> int:
    kafka = import_kafka()
    result = TourResult()
    with embedded_broker() as broker:
        admin_port = free_port(HOST)
        config = proxy_config(broker, rules=[str(rules_file)], admin={"listen": f"{HOST}:{admin_port}"},
                              traffic_log={"dir": str(log_dir)})
        admin_url = f"http://{HOST}:{admin_port}"
        with ProxyThread(config) as proxy:
            print(f"  tansu broker   {broker}  (embedded, memory storage)")
            print(f"  kproxy         {proxy.bootstrap}, admin {admin_url}")
            print(f"  rules          {rules_file}\n", flush=True)
            _tenant_step(kafka, proxy.bootstrap, broker, result)
            print("1. A tenant on a shared cluster (rule 'tenant-a': client ids tenant-a-*)")
            print(f"   {TENANT_CLIENT} created topic '{TOPIC}' and produced 20 records to it")
            print(f"   topics the client sees     {', '.join(result.client_topics) or 'none'}")
            print(f"   topics the broker holds    {', '.join(result.broker_topics) or 'none'}\n")
            print("2. A refused topic (rule 'no-secrets': topics secret-*)")
            print(f"   {TENANT_CLIENT} producing to '{DENIED_TOPIC}': "
                  f"{result.denied_error or 'NOT refused'} (TOPIC_AUTHORIZATION_FAILED, as from a broker's ACLs)\n",
                  flush=True)
            _quota_step(kafka, proxy.bootstrap, result)
            print(f"3. A producer held to its quota (quota 'bulk-loader': {QUOTA_BYTES_PER_S // 1024} KiB/s, "
                  "and a quiet client may use 1 s of it at once)")
            print("\n".join(_quota_lines(result)))
            print(f"   kafka-python reports throttle-time-max {result.client_throttle_ms:.0f} ms "
                  "(the throttle_time_ms kproxy put in its Produce answers)\n", flush=True)
            result.metrics = _scrape(admin_url)
        # Leaving the block drains kproxy, which finishes the traffic log's files.
    _read_log(log_dir, result)
    print(f"4. What kproxy recorded\n   {admin_url}/metrics (while it ran):")
    print("\n".join(f"     {line}" for line in result.metrics))
    denied = _line_of(result, rule="no-secrets")
    files = len(result.log_files)
    print(f"   traffic log: {log_dir}  ({len(result.log_lines)} lines in {files} file{'s' if files != 1 else ''})")
    if denied is not None:
        shown = {k: denied.get(k) for k in ("client_id", "api", "rule", "action", "error")}
        print(f"   the refused request: {json.dumps(shown)}")
    print()

    report_html = None
    print("5. The fleet report over that traffic log (kproxy report, PySpark)")
    if reporter is None:
        print(f"   skipped: {missing}")
    else:
        print("   running kproxy report (its Spark session started with step 1) ...", flush=True)
        started = time.perf_counter()
        ok, tail = reporter.run(log_dir, work / "report")
        if ok:
            report_html = work / "report" / "report.html"
            print(f"   report.html: {report_html}  ({time.perf_counter() - started:.1f} s)")
        else:
            print("   kproxy report FAILED:\n" + "\n".join(f"     {line}" for line in tail))

    problems = _problems(result)
    if reporter is not None and report_html is None:
        problems.append("kproxy report did not write report.html")
    print()
    if problems:
        print(f"tour check: FAILED: {'; '.join(problems)}")
        print(f"kproxy demo: FAILED: {'; '.join(problems)}", file=sys.stderr)
        return 1
    print("tour check: PASSED: tenant namespace, refused topic, throttled producer, metrics and traffic log")
    print(f"done in {time.perf_counter() - wall:.1f} s; files in {work}")
    return 0


def _problems(result: TourResult) -> list[str]:
    problems = []
    if TOPIC not in result.client_topics or any(t.startswith(TENANT_PREFIX) for t in result.client_topics):
        problems.append(f"the tenant saw {result.client_topics}, not '{TOPIC}' without its prefix")
    if TENANT_PREFIX + TOPIC not in result.broker_topics:
        problems.append(f"the broker holds {result.broker_topics}, not '{TENANT_PREFIX}{TOPIC}'")
    if result.denied_error != "TopicAuthorizationFailedError":
        problems.append(f"'{DENIED_TOPIC}' was not refused with TOPIC_AUTHORIZATION_FAILED "
                        f"({result.denied_error or 'it was written'})")
    if result.client_throttle_ms <= 0:
        reached = sum(result.quota_acked) / len(result.quota_acked) if result.quota_acked else 0.0
        if reached < QUOTA_BYTES_PER_S:
            # Nothing to throttle: the step shows nothing about the quota either way.
            problems.append(f"{QUOTA_CLIENT} reached only {reached / 1024:.0f} KiB/s, under its quota of "
                            f"{QUOTA_BYTES_PER_S // 1024} KiB/s, so kproxy had nothing to throttle (this "
                            "machine is too slow or too busy for the quota step; try again when it is quieter)")
        else:
            problems.append("the quota's producer reported no throttle")
    if steady_rate(result.quota_acked) > QUOTA_BYTES_PER_S * 1.25:
        problems.append(f"{QUOTA_CLIENT} ran at {steady_rate(result.quota_acked) / 1024:.0f} KiB/s after the burst, "
                        f"above its quota of {QUOTA_BYTES_PER_S // 1024} KiB/s")
    if not any(line.startswith("kproxy_throttle_seconds_total") for line in result.metrics):
        problems.append("/metrics shows no throttle")
    if _line_of(result, rule="no-secrets") is None:
        problems.append("the traffic log has no line for the refused request")
    return problems

