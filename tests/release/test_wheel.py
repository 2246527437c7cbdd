"""The package as a user gets it: ``python -m build`` makes an sdist and a wheel from the repository,
the wheel is installed into a fresh virtual environment outside the repository, and the ``kproxy``
command there checks every example rule file and decodes a frame (so the schema files are inside).
A second wheel, built from the sdist with no C compiler, runs the same on the pure-Python path.

The distribution is ``kproxy-kafka`` (``kproxy`` on the package index is an unrelated project); its
files are named ``kproxy_kafka-VERSION...``, and it installs the ``kproxy`` package and command."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import kproxy

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTION = "kproxy-kafka"
FILE_PREFIX = "kproxy_kafka"      # the name in wheel, sdist and .dist-info names (PEP 427, PEP 625)
RULE_FILES = sorted((REPO / "rules").glob("*.yaml"))
API_VERSIONS_FRAME = "00 00 00 17 00 12 00 03 00 00 00 07 00 02 63 31 00 05 6b 63 61 74 04 31 2e 37 00"
BUILD_TIMEOUT_S = 300


def run(argv: list[str | Path], cwd: Path, env: dict[str, str] | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, input=stdin, capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without this checkout's venv or source on any path, so nothing leaks in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KPROXY_CODEC")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(REPO)))
    return {**env, **extra}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist and wheel, as ``python -m build`` makes them (the wheel from the unpacked sdist)."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", out, REPO], cwd=REPO)
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, dist: Path) -> Path:
    """A fresh virtual environment outside the repository with the built wheel installed. It is made
    without a pip of its own and this interpreter's pip installs into it (``pip --python``): the
    same files land in it, and seeding a pip into every fresh venv cost about half this fixture."""
    where = tmp_path_factory.mktemp("fresh")
    assert not where.is_relative_to(REPO)
    run([sys.executable, "-m", "venv", "--without-pip", where / "venv"], cwd=where)
    (wheel,) = dist.glob("*.whl")
    pip(where / "venv", "install", "--quiet", wheel, cwd=where)
    return where / "venv"


def pip(venv: Path, *args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """This interpreter's pip acting on ``venv`` (which has none of its own)."""
    return run([sys.executable, "-m", "pip", "--python", venv / "bin/python", *args], cwd=cwd, env=clean_env())


def kproxy_cmd(venv: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run([venv / "bin/kproxy", *args], cwd=venv.parent, env=clean_env(), stdin=stdin)


def test_build_makes_an_sdist_and_a_wheel_that_twine_accepts(dist: Path):
    names = sorted(p.name for p in dist.iterdir())
    version = kproxy.__version__
    assert names[0].startswith(f"{FILE_PREFIX}-{version}-cp3") and names[0].endswith(".whl"), names
    assert names[1] == f"{FILE_PREFIX}-{version}.tar.gz", names
    twine = run([sys.executable, "-m", "twine", "check", "--strict", *dist.iterdir()], cwd=dist)
    assert twine.stdout.count("PASSED") == 2, twine.stdout


def test_the_wheel_holds_the_data_files_and_the_accelerator(dist: Path):
    (wheel,) = dist.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    schema_dir = REPO / "kproxy/protocol/schema"
    assert {f"kproxy/protocol/schema/{p.name}" for p in schema_dir.glob("*.kschema")} <= set(names)
    assert "kproxy/telemetry/traffic_log.schema.json" in names
    assert any(n.startswith("kproxy/protocol/_accel.") and n.endswith(".so") for n in names), names
    assert any(n.startswith("kproxy/server/_lane.") and n.endswith(".so") for n in names), names
    assert not [n for n in names if n.endswith(".c") or n.startswith("tests/")]
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        assert f"{FILE_PREFIX}-{kproxy.__version__}/kproxy/protocol/_accel.c" in tar.getnames()
        assert f"{FILE_PREFIX}-{kproxy.__version__}/kproxy/server/_lane.c" in tar.getnames()


def test_the_wheel_and_the_sdist_carry_the_license_text(dist: Path):
    version = kproxy.__version__
    license_text = (REPO / "LICENSE").read_bytes()
    assert b"Apache License" in license_text and b"Version 2.0, January 2004" in license_text
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        assert whl.read(f"{FILE_PREFIX}-{version}.dist-info/licenses/LICENSE") == license_text
        metadata = whl.read(f"{FILE_PREFIX}-{version}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines(), metadata[:2000]
    assert "License-File: LICENSE" in metadata.splitlines(), metadata[:2000]
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"{FILE_PREFIX}-{version}/LICENSE")
        assert member is not None and member.read() == license_text


def test_the_package_index_page_names_the_distribution_and_links_out(dist: Path):
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        metadata = email.message_from_bytes(whl.read(f"{FILE_PREFIX}-{kproxy.__version__}.dist-info/METADATA"))
    assert metadata["Name"] == DISTRIBUTION
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL", []))
    assert {"Homepage", "Documentation", "Repository", "Changelog", "Issues"} <= urls.keys(), urls
    description = metadata.get_payload()
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert description.startswith("# kproxy\n")
    # The description is the README; on the index a link must be absolute to lead anywhere.
    links = re.findall(r"\]\(([^)]+)\)", description)
    assert links and [link for link in links if not link.startswith("https://")] == [], links
    assert f"{urls['Documentation']}getting-started/" in links and urls["Changelog"] in links


def test_kproxy_from_the_fresh_venv_is_the_installed_one(venv: Path):
    assert kproxy_cmd(venv, "--version").stdout.strip() == f"kproxy {kproxy.__version__}"
    # Installed as kproxy-kafka, imported and run as kproxy.
    shown = pip(venv, "show", DISTRIBUTION, cwd=venv.parent).stdout
    assert f"Name: {DISTRIBUTION}\nVersion: {kproxy.__version__}\n" in shown, shown
    where = run([venv / "bin/python", "-c", "import kproxy; print(kproxy.__file__)"], cwd=venv.parent,
                env=clean_env()).stdout.strip()
    assert Path(where).is_relative_to(venv), where


@pytest.mark.parametrize("rules", RULE_FILES, ids=lambda p: p.name)
def test_kproxy_check_accepts_each_example_rule_file(venv: Path, rules: Path, tmp_path: Path):
    copy = tmp_path / rules.name  # outside the repository, as a user's own file
    copy.write_bytes(rules.read_bytes())
    # Record rules name JSON Schema files relative to the rule file: they go along.
    shutil.copytree(rules.parent / "schemas", tmp_path / "schemas")
    chaos = ["--chaos"] if rules.name == "chaos.yaml" else []
    out = kproxy_cmd(venv, "check", *chaos, "--rules", str(copy)).stdout
    assert out.startswith(f"ok: {copy}:"), out


def test_kproxy_check_of_the_example_config_names_the_native_codec(venv: Path, tmp_path: Path):
    copy = tmp_path / "kproxy.yaml"
    copy.write_bytes((REPO / "kproxy.example.yaml").read_bytes())
    # ... and the users file its `sasl` section names, relative to itself.
    (tmp_path / "users.example.yaml").write_bytes((REPO / "users.example.yaml").read_bytes())
    (tmp_path / "rules").mkdir()
    for rules in RULE_FILES:  # the example names rules/allow-all.yaml, relative to itself
        (tmp_path / "rules" / rules.name).write_bytes(rules.read_bytes())
    shutil.copytree(REPO / "rules" / "schemas", tmp_path / "rules" / "schemas")
    out = kproxy_cmd(venv, "check", str(copy)).stdout
    assert "codec generated Python with the native accelerator" in out, out


def test_kproxy_decode_reads_a_frame_with_the_shipped_schema(venv: Path):
    out = kproxy_cmd(venv, "decode", "-", stdin=API_VERSIONS_FRAME).stdout
    assert '"api": "api_versions"' in out and '"client_software_name": "kcat"' in out, out


def test_a_wheel_built_without_a_compiler_runs_in_pure_python(dist: Path, venv: Path, tmp_path: Path):
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (src,) = tmp_path.glob(f"{FILE_PREFIX}-*")
    built = run([sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "nocc", src], cwd=tmp_path,
                env=clean_env(CC=str(tmp_path / "no-compiler-here")))
    assert 'building extension "kproxy.protocol._accel" failed' in built.stdout + built.stderr
    assert 'building extension "kproxy.server._lane" failed' in built.stdout + built.stderr
    (wheel,) = (tmp_path / "nocc").glob("*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    bare = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", bare], cwd=tmp_path)
    # The fresh venv's dependencies are reused (a .pth file), kproxy itself comes from the new wheel.
    site = run([venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
               cwd=tmp_path, env=clean_env()).stdout.strip()
    bare_site = run([bare / "bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                    cwd=tmp_path, env=clean_env()).stdout.strip()
    Path(bare_site, "fresh-venv-deps.pth").write_text(site + "\n")
    pip(bare, "install", "--quiet", "--no-deps", "--ignore-installed", wheel, cwd=tmp_path)
    out = run([bare / "bin/kproxy", "decode", "-"], cwd=tmp_path, env=clean_env(), stdin=API_VERSIONS_FRAME)
    assert '"api": "api_versions"' in out.stdout
    said = run([bare / "bin/python", "-c", "import kproxy, kproxy.protocol.compiler as c, kproxy.server.lane as l; "
                "print(kproxy.__file__); print(c.codec_implementation()); print(c.accelerator_warning()); "
                "print(l.AVAILABLE)"],
               cwd=tmp_path, env=clean_env()).stdout.splitlines()
    assert Path(said[0]).is_relative_to(bare), said
    assert said[1] == "generated Python (accelerator not built)"
    assert "no kproxy.protocol._accel extension" in said[2] and "circular" not in said[2]
    assert said[3] == "False"       # no lane: nothing is handed to it
