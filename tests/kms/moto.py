"""The tests' AWS KMS: moto's server mode (``moto[server]``), an emulator of the AWS KMS API, on a free
loopback port, with its request recorder on so tests count the calls the server received."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.kms.process import ServerProcess

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}
REGION = "eu-west-1"


class MotoKms(ServerProcess):
    name = "moto"

    def command(self) -> list[str]:
        binary = shutil.which("moto_server", path=str(Path(sys.executable).parent))
        if binary is None:
            raise RuntimeError("moto_server is not installed: pip install 'moto[server]' (the dev extra has it)")
        return [binary, "-H", "127.0.0.1", "-p", str(self.port)]

    def answers(self) -> bool:
        try:
            return httpx.post(f"{self.url}/moto-api/recorder/start-recording", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, ready_timeout: float = 30.0) -> MotoKms:
        super().start(ready_timeout)
        return self

    def client(self) -> Any:
        import boto3

        return boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                     region_name=REGION).client("kms", endpoint_url=self.url)

    def requests(self, operation: str) -> int:
        """Calls of ``operation`` (e.g. ``GenerateDataKey``) the server received."""
        text = httpx.get(f"{self.url}/moto-api/recorder/download-recording", timeout=10).text
        target = f"TrentService.{operation}"
        return sum(1 for line in text.splitlines()
                   if line.strip() and json.loads(line).get("headers", {}).get("X-Amz-Target") == target)
