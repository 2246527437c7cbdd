"""The tests' tansu broker (kproxy's own launcher, plus the cluster's node id), free ports, unique names.

Memory storage only: a restart empties the broker. Nothing here knows about pytest.
"""

from __future__ import annotations

import re
import uuid

from kproxy.tansu import Tansu, free_port

__all__ = ["Tansu", "TansuBroker", "free_port", "unique_name"]


def unique_name(prefix: str) -> str:
    """A Kafka-legal topic or group name ([a-zA-Z0-9._-], well under 249 chars), unique per call."""
    clean = re.sub(r"[^a-zA-Z0-9._-]+", "-", prefix).strip("-")[:80] or "e2e"
    return f"{clean}-{uuid.uuid4().hex[:10]}"


class TansuBroker(Tansu):
    """kproxy's tansu launcher (``kproxy.tansu.Tansu``), plus what the tests read off the cluster once it
    answers: ``node_id`` (tansu uses 111) and ``cluster_id``. Memory storage: ``stop()`` then
    ``start()`` gives an empty broker on the same port; the node id survives.
    """

    def __init__(self, binary: str, host: str = "127.0.0.1", port: int | None = None, *,
                 silent: bool = True) -> None:
        super().__init__(binary, host, port, silent=silent)
        self.node_id: int | None = None
        self.cluster_id: str | None = None

    def __repr__(self) -> str:
        return f"TansuBroker({self.bootstrap}, node_id={self.node_id}, running={self.running})"

    def start(self, ready_timeout: float = 10.0) -> TansuBroker:
        if not self.running:
            super().start(ready_timeout)
            self._discover_cluster()
        return self

    def _discover_cluster(self) -> None:
        from tests.e2e.scenarios import kafka_python_describe_cluster_raw

        info = kafka_python_describe_cluster_raw(self.bootstrap)
        self.cluster_id = info["cluster_id"]
        self.node_id = int(info["brokers"][0]["broker_id"])
