"""The identity settings: `sasl` and `upstream.sasl` checked with file:line, secrets kept out of
/config, `kproxy users add` and `kproxy check` on the users file, and the users file reloaded when
it changes."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import trio

from kproxy.cli import main
from kproxy.config import ConfigError, load_config
from kproxy.identity.users import password_matches
from kproxy.protocol.messages import body_class
from kproxy.proxy.filters import ConnectionContext
from kproxy.server import admin
from kproxy.server.identity import IdentityService
from kproxy.userfile import add_user, load_users_file
from tests.unit.test_session import Clock, request_frame

BASE = """\
listen: "127.0.0.1:9092"
upstream:
  bootstrap_servers: ["kafka:9092"]
"""


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kproxy.yaml"
    path.write_text(BASE + text)
    return path


def error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(config(tmp_path, text))
    return str(e.value)


@pytest.fixture
def users(tmp_path: Path) -> Path:
    path = tmp_path / "users.yaml"
    add_user(str(path), "alice", "pw")
    return path


def test_a_full_identity_config_loads(tmp_path: Path, users: Path) -> None:
    (tmp_path / "secret").write_text("s3cret\n")
    cfg = load_config(config(tmp_path, """\
  sasl:
    mechanism: oauthbearer
    oauth:
      token_endpoint_url: https://idp.example/token
      client_id: kproxy
      client_secret_file: secret
      extensions: {logicalCluster: lkc-1}
sasl:
  mechanisms: scram-sha-512, PLAIN
  users_file: users.yaml
  max_session_s: 60
"""))
    assert cfg.sasl is not None and cfg.sasl.mechanisms == ("SCRAM-SHA-512", "PLAIN")
    assert cfg.sasl.users_file == str(users)                  # relative to the config file
    up = cfg.upstream.sasl
    assert up is not None and up.mechanism == "OAUTHBEARER" and up.oauth is not None
    assert up.oauth.client_secret_file == str(tmp_path / "secret")


@pytest.mark.parametrize(("text", "expected"), [
    ("sasl:\n  mechanisms: [SCRAM-SHA-1]\n  users_file: users.yaml\n",
     ":5: sasl.mechanisms[0]: must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER, GSSAPI; "
     "got 'SCRAM-SHA-1'"),
    ("sasl:\n  mechanisms: [PLAIN]\n", ":5: sasl.mechanisms: PLAIN and SCRAM check clients against sasl.users_file"),
    ("sasl:\n  mechanisms: [OAUTHBEARER]\n", ":5: sasl.mechanisms: OAUTHBEARER needs sasl.oauth"),
    ("sasl:\n  mechanisms: [PLAIN, PLAIN]\n  users_file: users.yaml\n", "sasl.mechanisms[1]: lists PLAIN twice"),
    ("sasl:\n  mechanisms: [PLAIN]\n  users_file: nope.yaml\n", ":6: sasl.users_file: file not found"),
    ("sasl:\n  mechanisms: [OAUTHBEARER]\n  oauth:\n    jwks_url: http://idp.example/jwks\n    issuer: i\n"
     "    audience: a\n", ":7: sasl.oauth.jwks_url: http:// is allowed only for a loopback address"),
    ("  sasl:\n    mechanism: SCRAM-SHA-512\n    username: svc\n",
     ":4: upstream.sasl.password: needs a password: password (from ${VAR}) or password_file"),
    ("  sasl:\n    mechanism: SCRAM-SHA-512\n    password: x\n", ":4: upstream.sasl.username: SCRAM-SHA-512 needs"),
    ("  sasl:\n    mechanism: OAUTHBEARER\n", ":5: upstream.sasl.mechanism: OAUTHBEARER needs upstream.sasl.oauth"),
    ("  sasl:\n    mechanism: OAUTHBEARER\n    oauth:\n      token_endpoint_url: https://u:p@idp/t\n"
     "      client_id: k\n      client_secret: s\n", "put credentials in client_secret"),
    # Kerberos (GSSAPI): the principal written whole, the keytab there, the rules readable.
    ("  sasl:\n    mechanism: GSSAPI\n", ":5: upstream.sasl.mechanism: GSSAPI needs upstream.sasl.principal"),
    ("  sasl:\n    mechanism: GSSAPI\n    principal: kproxy\n    keytab: users.yaml\n",
     ":6: upstream.sasl.principal: 'kproxy' is not a Kerberos principal; write it whole, with its realm"),
    ("  sasl:\n    mechanism: GSSAPI\n    principal: kproxy@EX.COM\n    keytab: no.keytab\n",
     ":7: upstream.sasl.keytab: file not found"),
    ("  sasl:\n    mechanism: GSSAPI\n    principal: kproxy@EX.COM\n    keytab: users.yaml\n    username: svc\n",
     ":8: upstream.sasl.username: GSSAPI logs in with principal and keytab; remove it"),
    ("  sasl:\n    mechanism: SCRAM-SHA-512\n    username: svc\n    password: x\n    keytab: users.yaml\n",
     ":8: upstream.sasl.keytab: is read only with mechanism: GSSAPI"),
    ("sasl:\n  mechanisms: [GSSAPI]\n", ":5: sasl.mechanisms: GSSAPI needs sasl.gssapi (principal, keytab)"),
    ("sasl:\n  mechanisms: [GSSAPI]\n  gssapi:\n    principal: kafka@EX.COM\n    keytab: users.yaml\n",
     ":7: sasl.gssapi.principal: 'kafka@EX.COM' is not a service principal; write service/host@REALM"),
    ("sasl:\n  mechanisms: [GSSAPI]\n  gssapi:\n    principal: kafka/h@EX.COM\n    keytab: no.keytab\n",
     ":8: sasl.gssapi.keytab: file not found"),
    ("sasl:\n  mechanisms: [GSSAPI]\n  gssapi:\n    principal: kafka/h@EX.COM\n    keytab: users.yaml\n"
     "    principal_to_local:\n      - DEFAULT\n      - RULE:[1:$1]/l\n",
     ":11: sasl.gssapi.principal_to_local[1]: rule 'RULE:[1:$1]/l': cannot read 'RULE:[1:$1]/l'"),
])
def test_errors_name_the_setting_and_line(tmp_path: Path, users: Path, text: str, expected: str) -> None:
    assert expected in error(tmp_path, text)


def test_http_urls_on_loopback_are_allowed(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, "sasl:\n  mechanisms: [OAUTHBEARER]\n  oauth:\n"
                                       "    jwks_url: http://127.0.0.1:8080/jwks\n    issuer: i\n    audience: a\n"))
    assert cfg.sasl is not None and cfg.sasl.oauth is not None


def test_config_endpoint_redacts_every_identity_secret(tmp_path: Path, users: Path) -> None:
    cfg = load_config(config(tmp_path, """\
  sasl:
    mechanism: SCRAM-SHA-512
    username: svc
    password: pa55-word
    oauth:
      token_endpoint_url: https://idp.example/token
      client_id: kproxy
      client_secret: cl1ent-secret
      extensions: {logicalCluster: lkc-secretish}
sasl:
  mechanisms: [PLAIN]
  users_file: users.yaml
"""))
    shown = json.dumps(admin.public_config(cfg))
    for secret in ("pa55-word", "cl1ent-secret", "lkc-secretish"):
        assert secret not in shown
    view = admin.public_config(cfg)
    assert view["upstream"]["sasl"]["mechanism"] == "SCRAM-SHA-512" and view["upstream"]["sasl"]["username"] == "svc"
    assert view["sasl"]["mechanisms"] == ["PLAIN"]


def test_users_add_from_stdin_and_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "users.yaml"
    monkeypatch.setattr("sys.stdin", io.StringIO("from-stdin\n"))
    assert main(["users", "add", "alice", "--users-file", str(path)]) == 0
    (tmp_path / "pw").write_text("from-file\n")
    assert main(["users", "add", "bob", "--users-file", str(path), "--mechanism", "scram-sha-512",
                 "--password-file", str(tmp_path / "pw"), "--iterations", "5000"]) == 0
    text = path.read_text()
    assert "from-stdin" not in text and "from-file" not in text
    assert os.stat(path).st_mode & 0o077 == 0
    book = load_users_file(str(path))
    alice, bob = book.credential("alice", "SCRAM-SHA-256"), book.credential("bob", "SCRAM-SHA-512")
    assert alice is not None and password_matches("SCRAM-SHA-256", alice, "from-stdin")
    assert bob is not None and bob.iterations == 5000 and password_matches("SCRAM-SHA-512", bob, "from-file")
    assert book.credential("bob", "SCRAM-SHA-256") is None
    assert main(["users", "add", "carol", "--users-file", str(path), "--mechanism", "PLAIN"]) == 2
    assert "--mechanism must be one of" in capsys.readouterr().err


def test_check_reports_a_broken_users_file_with_its_line(tmp_path: Path, users: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, "sasl:\n  mechanisms: [PLAIN]\n  users_file: users.yaml\n")
    assert main(["check", str(path)]) == 0
    users.write_text(users.read_text().replace("iterations: 4096", "iterations: 12", 1))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{users}:" in err and "iterations: must be an integer of at least 4096" in err
    line = int(err.split(f"{users}:")[1].split(":")[0])
    assert "iterations: 12" in users.read_text().splitlines()[line - 1]


def test_the_users_file_is_reloaded_when_it_changes_and_a_broken_one_is_ignored(tmp_path: Path, users: Path) -> None:
    service = IdentityService(load_config(config(tmp_path, "sasl:\n  mechanisms: [PLAIN]\n  users_file: users.yaml\n")))
    assert service.settings is not None and set(service.settings.users.users) == {"alice"}
    add_user(str(users), "bob", "pw2")
    os.utime(users, (1, 1))
    service._reload_users()
    assert set(service.settings.users.users) == {"alice", "bob"}
    users.write_text("users: {bob: {SCRAM-SHA-1: {}}}\n")
    os.utime(users, (2, 2))
    service._reload_users()
    assert set(service.settings.users.users) == {"alice", "bob"}     # the old users stay


def test_no_password_is_checked_ahead_for_a_saslauthenticate_outside_an_exchange(tmp_path: Path, users: Path) -> None:
    """The PBKDF2 of a PLAIN login runs ahead, in a thread, only while an exchange is under way: a
    SaslAuthenticate after a re-authentication refused as too soon costs no key derivation."""
    service = IdentityService(load_config(config(tmp_path, "sasl:\n  mechanisms: [PLAIN]\n  users_file: users.yaml\n")))
    clock = Clock(100.0)
    front = service.front(ConnectionContext(1, clock=clock))
    assert front is not None and front.termination is not None
    t = front.termination
    message = b"\x00alice\x00pw"
    frame = memoryview(request_frame(36, 2, 3, body_class(36, "request")(auth_bytes=message)))

    async def prepare() -> None:
        await service.prepare(front, frame, discover=None)

    assert t.handshake("PLAIN", 1) == 0
    trio.run(prepare)
    assert list(t.plain_checked.values()) == [True]          # worked out ahead during the exchange
    assert t.authenticate(message).done
    assert t.handshake("PLAIN", 1) == 0                        # the first re-authentication
    assert t.authenticate(message).done
    clock.now = 100.5
    assert t.handshake("PLAIN", 1) != 0                        # too soon: no exchange begun
    trio.run(prepare)
    assert t.plain_checked == {}
