"""A throwaway Kerberos realm for the tests: Debian's MIT KDC (``krb5-kdc``), with its database,
configuration, keytabs and credential caches in one temporary folder.

The realm is made with ``kdb5_util create -s`` and filled with ``kadmin.local``, whose exit status says
nothing (it exits 0 when a command fails), so every command's output is read for the line that says it
worked. ``krb5kdc -n`` serves it in the foreground on a free loopback port (TCP only). Everything that
reads Kerberos settings is pointed at the folder by ``env()``: ``KRB5_CONFIG`` and ``KRB5_KDC_PROFILE``
for the configuration, a private ``KRB5CCNAME`` so no ticket lands in the machine's default cache, a
private replay cache folder, and ``KRB5_KTNAME`` set to a keytab that holds nothing kproxy could use,
so a component that fell back to the default keytab instead of its configured one would fail.

A ticket is good until its end time plus the clock skew allowed (``clockskew``, 300 s by default in
MIT krb5); the realm allows 2 s, so a test sees a ticket refused as expired seconds after its end.
``krb5.conf`` turns host name canonicalisation off (``dns_canonicalize_hostname``, ``rdns``): a client
that connects to 127.0.0.1 asks for ``kafka/127.0.0.1``, with no DNS involved. Nothing here knows
about pytest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

REALM = "KPROXY.TEST"
MASTER_PASSWORD = "kdc-master-Pw-19"     # the throwaway database's master key; nothing outside uses it
TOOLS = ("krb5kdc", "kdb5_util", "kadmin.local", "kinit", "klist")


def tool(name: str) -> str | None:
    """The path of an MIT Kerberos tool (the KDC's live in /usr/sbin, which PATH may lack)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def missing_tools() -> list[str]:
    return [t for t in TOOLS if tool(t) is None]


class KadminError(RuntimeError):
    """A kadmin.local command did not do what was asked; the message holds its output."""


class Realm:
    """One realm and its KDC. ``start()`` creates and serves it; ``stop()`` ends the KDC."""

    def __init__(self, folder: Path, realm: str = REALM, *, max_life: str = "10h", clockskew: int = 2) -> None:
        self.folder = folder
        self.realm = realm
        self.max_life = max_life
        self.clockskew = clockskew
        self.port = _free_tcp_port()
        self.krb5_conf = folder / "krb5.conf"
        self.kdc_conf = folder / "kdc.conf"
        self.log = folder / "kdc.log"
        self.default_keytab = folder / "default.keytab"     # KRB5_KTNAME: holds no key anyone uses
        self.ccache = folder / "ccache"
        self._process: subprocess.Popen[bytes] | None = None
        self._made: set[str] = set()

    # -- the environment every Kerberos user in the tests runs in

    def env(self, ccache: Path | None = None) -> dict[str, str]:
        return {
            "KRB5_CONFIG": str(self.krb5_conf),
            "KRB5_KDC_PROFILE": str(self.kdc_conf),
            "KRB5CCNAME": f"FILE:{ccache or self.ccache}",
            "KRB5_KTNAME": f"FILE:{self.default_keytab}",
            "KRB5_CLIENT_KTNAME": f"FILE:{self.default_keytab}",
            "KRB5RCACHEDIR": str(self.folder),
        }

    @contextlib.contextmanager
    def environment(self, ccache: Path | None = None) -> Iterator[None]:
        """This process's environment pointed at the realm for the block, then restored."""
        saved = {key: os.environ.get(key) for key in self.env()}
        os.environ.update(self.env(ccache))
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    # -- life

    def start(self, ready_timeout: float = 20.0) -> Realm:
        missing = missing_tools()
        if missing:
            raise RuntimeError(f"MIT Kerberos tools missing: {', '.join(missing)} (`make system-deps` installs "
                               "krb5-kdc, krb5-admin-server and krb5-user)")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_config()
        self._run([tool("kdb5_util") or "kdb5_util", "-r", self.realm, "create", "-s", "-P", MASTER_PASSWORD],
                  expect=None)
        # The keytab KRB5_KTNAME names: a principal nobody asks for, so it exists and is useless.
        self.add_principal(f"nobody/unused@{self.realm}")
        self.keytab(self.default_keytab, f"nobody/unused@{self.realm}")
        self._process = subprocess.Popen([tool("krb5kdc") or "krb5kdc", "-n", "-r", self.realm],
                                         env={**os.environ, **self.env()}, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"krb5kdc exited with {self._process.returncode}; see {self.log}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"krb5kdc did not listen on 127.0.0.1:{self.port} within {ready_timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        p, self._process = self._process, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def __enter__(self) -> Realm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- principals and keytabs

    def principal(self, name: str) -> str:
        return name if "@" in name else f"{name}@{self.realm}"

    def add_principal(self, name: str, *, password: str | None = None, max_life: str | None = None) -> str:
        """Create ``name`` (a random key unless ``password``); its full name. Asking again for one this
        realm made already only sets its maximum ticket life (test files share the session's realm)."""
        full = self.principal(name)
        if full in self._made:
            if max_life:
                self.set_max_life(full, max_life)
            return full
        self._made.add(full)
        key = f"-pw {password}" if password is not None else "-randkey"
        life = f' -maxlife "{max_life}"' if max_life else ""
        self.kadmin(f"addprinc {key}{life} {full}", expect=f'Principal "{full}" created.')
        return full

    def delete_principal(self, name: str) -> None:
        full = self.principal(name)
        self.kadmin(f"delprinc -force {full}", expect=f'Principal "{full}" deleted.')
        self._made.discard(full)

    def set_max_life(self, name: str, max_life: str) -> None:
        full = self.principal(name)
        self.kadmin(f'modprinc -maxlife "{max_life}" {full}', expect=f'Principal "{full}" modified.')

    def keytab(self, path: Path, name: str, *, keep_key: bool = False) -> Path:
        """Write ``name``'s keys to ``path`` (added to what it holds). Without ``keep_key`` this makes a new
        key (kvno + 1), so any keytab written before for ``name`` no longer works: a wrong keytab."""
        full = self.principal(name)
        norand = " -norandkey" if keep_key else ""
        self.kadmin(f"ktadd -k {path}{norand} {full}", expect=f"Entry for principal {full} with kvno")
        return path

    def kadmin(self, query: str, *, expect: str) -> str:
        return self._run([tool("kadmin.local") or "kadmin.local", "-r", self.realm, "-q", query], expect=expect)

    def kinit(self, name: str, keytab: Path, ccache: Path, *, lifetime: str | None = None) -> None:
        """Get a ticket-granting ticket for ``name`` from ``keytab`` into ``ccache``."""
        args = [tool("kinit") or "kinit", "-k", "-t", str(keytab), "-c", f"FILE:{ccache}"]
        if lifetime:
            args += ["-l", lifetime]
        self._run([*args, self.principal(name)], expect=None)

    def kdc_log(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- internals

    def _run(self, args: list[str], *, expect: str | None, env: Mapping[str, str] | None = None) -> str:
        done = subprocess.run(args, env={**os.environ, **self.env(), **(env or {})}, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
        out = done.stdout + done.stderr
        if done.returncode != 0 or (expect is not None and expect not in out):
            raise KadminError(f"{' '.join(args)} (exit {done.returncode}):\n{out}")
        return out

    def _write_config(self) -> None:
        f = self.folder
        self.krb5_conf.write_text(f"""\
[libdefaults]
    default_realm = {self.realm}
    dns_lookup_kdc = false
    dns_lookup_realm = false
    dns_canonicalize_hostname = false
    rdns = false
    udp_preference_limit = 1
    ticket_lifetime = {self.max_life}
    forwardable = false
    clockskew = {self.clockskew}

[realms]
    {self.realm} = {{
        kdc = 127.0.0.1:{self.port}
    }}

[domain_realm]
    127.0.0.1 = {self.realm}
    localhost = {self.realm}
""")
        self.kdc_conf.write_text(f"""\
[kdcdefaults]
    kdc_listen = ""
    kdc_tcp_listen = 127.0.0.1:{self.port}

[realms]
    {self.realm} = {{
        database_name = {f}/principal
        key_stash_file = {f}/stash
        acl_file = {f}/kadm5.acl
        max_life = {self.max_life}
        max_renewable_life = 0
        supported_enctypes = aes256-cts-hmac-sha1-96:normal aes128-cts-hmac-sha1-96:normal
        kdc_listen = ""
        kdc_tcp_listen = 127.0.0.1:{self.port}
    }}

[logging]
    kdc = FILE:{self.log}
    admin_server = FILE:{f}/kadmin.log
    default = FILE:{f}/krb5lib.log
""")
        (f / "kadm5.acl").write_text("")


def _free_tcp_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])
