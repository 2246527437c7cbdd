"""kcat (the Debian package) as one more real client: produce some records, consume them back.

Debian's kcat 1.7.1 is linked to librdkafka 2.0.2, which fails against tansu while parsing the
ApiVersions v3 response: tansu writes default-valued tagged fields (tags 0-3) and librdkafka 2.0.2
does not skip tagged-field data. Running the same kcat binary on the librdkafka 2.16 that the
confluent-kafka wheel bundles (an ABI-compatible librdkafka.so.1) works; `bundled_librdkafka_dir()`
prepares that.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

KCAT = "kcat"

# The legacy-protocol variant: no ApiVersions request, the 0.9.0 API set. Metadata and Fetch work
# against tansu, but Produce v1 carries a MessageSet v0 that tansu reads as a RecordBatch v2 (CRC error,
# connection closed), and ListOffsets v0 answers cannot be parsed: a round trip still fails.
SAMPLE_RECORDS = [(f"key-{i}", f"value-{i}") for i in range(10)]
"""(key, value) pairs the kcat tests send and expect back."""

LEGACY_PROTOCOL_ARGS = ("-X", "api.version.request=false", "-X", "broker.version.fallback=0.9.0")


def kcat_path() -> str | None:
    return shutil.which(KCAT)


def bundled_librdkafka_dir(directory: Path | None = None) -> Path | None:
    """A directory holding `librdkafka.so.1` -> the confluent-kafka wheel's librdkafka, for LD_LIBRARY_PATH."""
    try:
        import confluent_kafka
    except ImportError:
        return None
    libs = Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs"
    candidates = sorted(libs.glob("librdkafka-*.so.1"))
    if not candidates:
        return None
    version = confluent_kafka.libversion()[0]
    target = directory or Path(tempfile.gettempdir()) / f"kproxy-e2e-librdkafka-{version}"
    target.mkdir(parents=True, exist_ok=True)
    link = target / "librdkafka.so.1"
    if not link.exists():
        link.symlink_to(candidates[0])
    return target


def _run(argv: list[str], stdin: bytes | None, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        return -1, (exc.stdout or b"").decode(errors="replace"), f"timed out after {timeout}s"
    return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


def kcat_roundtrip(
    bootstrap: str,
    topic: str,
    records: Sequence[tuple[str, str]],
    *,
    extra_args: Sequence[str] = (),
    librdkafka_dir: Path | None = None,
    timeout: float = 20.0,
) -> tuple[bool, str]:
    """Produce (key, value) records with `kcat -P`, read them back with `kcat -C -e`.

    Returns (ok, output): ok when both commands exit 0 and the consumed (key, value) multiset equals
    `records`; output is both commands' stderr and stdout, for the failure message or a report.
    Keys and values must not contain a tab or a newline (they are kcat's delimiters here).
    """
    kcat = kcat_path()
    if kcat is None:
        return False, "kcat is not installed"
    for key, value in records:
        if any(ch in key + value for ch in "\t\n"):
            raise ValueError(f"record {key!r}: tabs and newlines are kcat delimiters")
    env = dict(os.environ)
    if librdkafka_dir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(librdkafka_dir), env.get("LD_LIBRARY_PATH")])
        )
    base = [kcat, "-b", bootstrap, "-t", topic, "-m", "5", *extra_args]

    lines = "".join(f"{key}\t{value}\n" for key, value in records).encode()
    rc, out, err = _run([*base, "-P", "-K", "\t"], lines, env, timeout)
    output = f"$ kcat -P (rc={rc})\n{err}{out}"
    if rc != 0:
        return False, output

    rc, out, err = _run([*base, "-C", "-e", "-q", "-o", "beginning", "-f", "%k\t%s\n"], None, env, timeout)
    output += f"$ kcat -C -e (rc={rc})\n{err}{out}"
    consumed = sorted(tuple(line.split("\t", 1)) for line in out.splitlines() if "\t" in line)
    return rc == 0 and consumed == sorted(records), output
