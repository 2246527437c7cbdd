"""A small OpenID provider for the tests: a JWKS and a client-credentials token endpoint over HTTP on
loopback, signing RS256 JWTs with keys made here. It stands in for Keycloak or any OIDC provider:
the same JSON documents, HTTP Basic client authentication (RFC 6749 2.3.1), and ``kid`` rotation.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa


class OidcProvider:
    """``clients`` maps client ids to secrets; a token's ``sub`` is the client id. ``audiences``
    may give a client another ``aud`` (to make bad tokens), ``lifetime_s`` sets ``expires_in``."""

    def __init__(self, clients: dict[str, str], *, audience: str = "kafka", lifetime_s: int = 300) -> None:
        self.clients = dict(clients)
        self.audience = audience
        self.audiences: dict[str, str] = {}
        self.lifetime_s = lifetime_s
        self.keys: dict[str, rsa.RSAPrivateKey] = {}
        self.signing_kid = self.add_key("k1")
        self.token_requests: list[tuple[str, str | None]] = []     # (client id, scope)
        self.jwks_requests = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add_key(self, kid: str) -> str:
        self.keys[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        return kid

    @property
    def base(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def issuer(self) -> str:
        return f"{self.base}/"

    @property
    def jwks_url(self) -> str:
        return f"{self.base}/jwks"

    @property
    def token_url(self) -> str:
        return f"{self.base}/token"

    def jwks(self) -> dict[str, Any]:
        out = []
        for kid, key in self.keys.items():
            data = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
            out.append({**data, "kid": kid, "use": "sig", "alg": "RS256"})
        return {"keys": out}

    def token(self, subject: str, *, kid: str | None = None, audience: str | None = None,
              lifetime_s: int | None = None, key: rsa.RSAPrivateKey | None = None) -> str:
        now = int(time.time())
        kid = kid or self.signing_kid
        claims = {"iss": self.issuer, "sub": subject, "aud": audience or self.audiences.get(subject, self.audience),
                  "iat": now, "nbf": now - 1, "exp": now + (lifetime_s or self.lifetime_s), "azp": subject}
        return jwt.encode(claims, key or self.keys[kid], algorithm="RS256", headers={"kid": kid})

    def start(self) -> OidcProvider:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OidcProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path != "/jwks":
                    self._send(404, {"error": "not_found"})
                    return
                provider.jwks_requests += 1
                self._send(200, provider.jwks())

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                if self.path != "/token" or form.get("grant_type") != ["client_credentials"]:
                    self._send(400, {"error": "unsupported_grant_type"})
                    return
                client_id, secret = _basic(self.headers.get("Authorization"))
                if client_id is None:   # client_secret_post, as some clients send
                    client_id = (form.get("client_id") or [None])[0]
                    secret = (form.get("client_secret") or [None])[0]
                if client_id is None or provider.clients.get(client_id) != secret:
                    self._send(401, {"error": "invalid_client"})
                    return
                scope = (form.get("scope") or [None])[0]
                provider.token_requests.append((client_id, scope))
                self._send(200, {"access_token": provider.token(client_id), "token_type": "Bearer",
                                 "expires_in": provider.lifetime_s})

        return Handler


def _basic(header: str | None) -> tuple[str | None, str | None]:
    if not header or not header.startswith("Basic "):
        return None, None
    user, _, password = base64.b64decode(header[6:]).decode().partition(":")
    return urllib.parse.unquote(user), urllib.parse.unquote(password)
