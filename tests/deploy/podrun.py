"""One rendered kproxy container run as its pod would run it, inside a private network namespace
(``python -m tests.deploy.podrun RESULT`` under ``tests.deploy.isolated``, plan as JSON on stdin).

It starts the container's exact command before the broker exists, probes it as the kubelet would,
starts a tansu broker, then drives a real client through the Service's ports, rewrites the rules
ConfigMap the way the kubelet does while that client stays connected, and ends with SIGTERM. It
records what it saw and asserts nothing: the test in the parent does.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kafka
import kafka.errors

from kproxy.tansu import Tansu
from tests.deploy.isolated import enter
from tests.deploy.pod import write_config_map_dir
from tests.e2e.scenarios import (
    kafka_python_create_topic,
    kafka_python_endpoints,
    kafka_python_produce_consume,
)


def http_get(host: str, port: int, path: str) -> tuple[int, str]:
    """Status and body of GET http://host:port/path, as an httpGet probe sends it; (0, reason) when
    nothing answers."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=2) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g}s")
        time.sleep(0.1)


def metric(text: str, name: str) -> float:
    """The sum of every series of ``name`` in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def run(plan: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    pod_ip, admin_port = plan["pod_ip"], plan["admin_port"]
    log = open(plan["log"], "wb")   # noqa: SIM115 (open for the child's whole life)
    kproxy = subprocess.Popen(plan["argv"], env=plan["env"], cwd=plan["cwd"], stdout=log, stderr=subprocess.STDOUT)
    broker = Tansu(host="127.0.0.1", port=plan["broker_port"])
    try:
        wait_for(lambda: kproxy.poll() is not None or http_get(pod_ip, admin_port, "/livez")[0] == 200, 20,
                 "kproxy answering /livez")
        if kproxy.poll() is not None:
            raise RuntimeError(f"kproxy exited with status {kproxy.returncode} at start")
        seen["before_broker"] = {p["path"]: http_get(pod_ip, p["port"], p["path"])[0] for p in plan["probes"]}
        if plan.get("helm_test_argv"):
            seen["helm_test_before_broker"] = subprocess.run(plan["helm_test_argv"], env=plan["helm_test_env"],
                                                             capture_output=True, timeout=30).returncode
        broker.start()
        wait_for(lambda: http_get(pod_ip, admin_port, "/readyz")[0] == 200, 20, "/readyz answering 200")
        seen["probes"] = {p["path"]: http_get(pod_ip, p["port"], p["path"]) for p in plan["probes"]}
        if plan.get("helm_test_argv"):
            test = subprocess.run(plan["helm_test_argv"], env=plan["helm_test_env"], capture_output=True, text=True,
                                  timeout=30)
            seen["helm_test"] = {"status": test.returncode, "output": test.stdout + test.stderr}

        bootstrap = plan["bootstrap"]
        seen["endpoints"] = [list(e) for e in kafka_python_endpoints(bootstrap)["DescribeCluster"]]
        records = kafka_python_produce_consume(bootstrap, f"k8s-{plan['name']}", 30)
        seen["records_read_back"] = len(records)

        # The application's producer stays connected through the reload and into the shutdown.
        producer = kafka.KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False,
                                       request_timeout_ms=10_000, max_block_ms=10_000, retries=0)
        try:
            seen["reload"] = reload_rules(plan, producer)
            start = time.monotonic()
            kproxy.send_signal(signal.SIGTERM)
            try:
                seen["exit_status"] = kproxy.wait(timeout=plan["grace_s"] + 5)
            except subprocess.TimeoutExpired:
                seen["exit_status"] = None
            seen["stop_s"] = time.monotonic() - start
        finally:
            producer.close(timeout=5)
    finally:
        if kproxy.poll() is None:
            kproxy.kill()
            kproxy.wait()
        broker.stop()
        log.close()
    return seen


def reload_rules(plan: dict[str, Any], producer: kafka.KafkaProducer) -> dict[str, Any]:
    """Swap the rules ConfigMap to one that denies producing to a topic while ``producer`` stays
    connected; what it saw before and after, and whether kproxy accepted new connections meanwhile."""
    pod_ip, admin_port = plan["pod_ip"], plan["admin_port"]
    blocked = f"blocked-{plan['name']}"
    kafka_python_create_topic(plan["bootstrap"], blocked, 1)
    out: dict[str, Any] = {"before": producer.send(blocked, b"before").get(timeout=10).offset}
    rules = json.loads(http_get(pod_ip, admin_port, "/rules")[1])
    opened = metric(http_get(pod_ip, admin_port, "/metrics")[1], "kproxy_connections_opened_total")
    write_config_map_dir(Path(plan["rules_dir"]), plan["new_rules"])
    wait_for(lambda: json.loads(http_get(pod_ip, admin_port, "/rules")[1])["generation"] > rules["generation"],
             15, "the rules reloaded")
    try:
        producer.send(blocked, b"after").get(timeout=10)
        out["after"] = "accepted"
    except kafka.errors.KafkaError as e:
        out["after"] = type(e).__name__
    out["other_topic_offset"] = producer.send(f"k8s-{plan['name']}", b"still here").get(timeout=10).offset
    out["connections_opened_during_reload"] = (
        metric(http_get(pod_ip, admin_port, "/metrics")[1], "kproxy_connections_opened_total") - opened)
    out["rules"] = json.loads(http_get(pod_ip, admin_port, "/rules")[1])
    return out


def main() -> int:
    result_path = Path(sys.argv[1])
    plan = json.loads(sys.stdin.read())
    enter(plan["hosts"], Path(plan["cwd"]))
    try:
        seen = run(plan)
    except Exception as e:
        seen = {"error": f"{type(e).__name__}: {e}"}
    seen["kproxy_log"] = Path(plan["log"]).read_text(errors="replace")[-6000:]
    result_path.write_text(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
