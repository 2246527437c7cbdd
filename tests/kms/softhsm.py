"""The tests' PKCS#11 token: Debian's SoftHSM (``softhsm2``) with its token directory in a temporary
folder (``SOFTHSM2_CONF``), initialised with ``softhsm2-util``. KEKs are made in a child process
(``python -m tests.kms.softhsm``), so that the test process's own login to the token is only ever
kproxy's: PKCS#11 logs in per process, and closing a session of the tests' would log kproxy out.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MODULES = ("/usr/lib/softhsm/libsofthsm2.so", "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
           "/usr/lib/aarch64-linux-gnu/softhsm/libsofthsm2.so")


def softhsm_module() -> str | None:
    return next((m for m in MODULES if os.path.exists(m)), None)


class SoftHsm:
    """One initialised token: ``module``, ``label``, ``pin_file``; ``create_key`` adds a KEK."""

    def __init__(self, workdir: Path, label: str = "kproxy-test") -> None:
        module, util = softhsm_module(), shutil.which("softhsm2-util")
        if module is None or util is None:
            raise RuntimeError("SoftHSM is not installed: `make system-deps` installs it (apt-get install softhsm2)")
        self.module, self.label = module, label
        (workdir / "tokens").mkdir()
        self.conf = workdir / "softhsm2.conf"
        self.conf.write_text(f"directories.tokendir = {workdir / 'tokens'}\nobjectstore.backend = file\n"
                             f"log.level = ERROR\n")
        self.pin = secrets.token_hex(4)
        self.pin_file = workdir / "pin"
        self.pin_file.write_text(f"{self.pin}\n")
        subprocess.run([util, "--init-token", "--free", "--label", label, "--pin", self.pin,
                        "--so-pin", secrets.token_hex(4)], env=self.env(), check=True, capture_output=True)

    def env(self) -> dict[str, str]:
        return {**os.environ, "SOFTHSM2_CONF": str(self.conf)}

    def create_key(self, label: str, key_id: bytes = b"\x01", *, wrap: bool = True) -> None:
        """An AES-256 key on the token, labelled ``label`` with CKA_ID ``key_id``."""
        subprocess.run([sys.executable, "-m", "tests.kms.softhsm", self.module, self.label, self.pin, label,
                        key_id.hex(), "wrap" if wrap else "encrypt"],
                       env=self.env(), check=True, capture_output=True, cwd=Path(__file__).parents[2])


def _create_key(module: str, token_label: str, pin: str, label: str, key_id: str, usage: str) -> None:
    import pkcs11
    from pkcs11 import Attribute, KeyType

    wrap = usage == "wrap"
    token = pkcs11.lib(module).get_token(token_label=token_label)
    with token.open(user_pin=pin, rw=True) as session:
        session.generate_key(KeyType.AES, 256, label=label, id=bytes.fromhex(key_id), store=True,
                             template={Attribute.WRAP: wrap, Attribute.UNWRAP: wrap, Attribute.ENCRYPT: not wrap,
                                       Attribute.DECRYPT: not wrap, Attribute.SENSITIVE: True,
                                       Attribute.EXTRACTABLE: False})


_SHARED: list[SoftHsm] = []


def shared_softhsm() -> SoftHsm:
    """The process's token. A PKCS#11 library reads its configuration once per process (python-pkcs11
    loads one library, once), so every test in a process shares one token; KEKs get unique labels."""
    if not _SHARED:
        work = Path(tempfile.mkdtemp(prefix="kproxy-softhsm-"))
        atexit.register(shutil.rmtree, work, True)
        _SHARED.append(SoftHsm(work))
        os.environ["SOFTHSM2_CONF"] = str(_SHARED[0].conf)
    return _SHARED[0]


if __name__ == "__main__":
    _create_key(*sys.argv[1:7])
