"""The documentation site: ``mkdocs build --strict`` over mkdocs.yml and docs/ passes, and the same
build fails on a page left out of the nav and on a broken link or anchor (so the check can fail).
README.md is a landing page whose links all resolve. It is also the package's description on the
package index, so every link in it is absolute: pages of the published site (mkdocs.yml's
``site_url``, which pyproject.toml's project URLs name too) or files of the repository. docs/index.md
is the README with those site links made relative, so the strict build checks their pages and anchors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"
SITE = yaml.safe_load((REPO / "mkdocs.yml").read_text())
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SITE_URL = SITE["site_url"]
REPO_URL = SITE["repo_url"]


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_site_builds_strictly(tmp_path: Path):
    built = mkdocs_build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "getting-started" / "index.html").is_file()
    assert (tmp_path / "site" / "search" / "search_index.json").is_file()


@pytest.mark.parametrize(("mistake", "said"), [
    ("stray-page", "not included in the \"nav\" configuration"),
    ("broken-link", "the target is not found among documentation files"),
    ("broken-anchor", "there is no such anchor on this page"),
])
def test_the_strict_build_fails_on_a_mistake(tmp_path: Path, mistake: str, said: str):
    root = tmp_path / "copy"
    root.mkdir()
    shutil.copy(REPO / "mkdocs.yml", root)
    shutil.copytree(DOCS, root / "docs")   # the changelog symlink is copied as a file
    if mistake == "stray-page":
        (root / "docs" / "stray.md").write_text("# A page nobody can reach\n")
    else:
        link = "[gone](nowhere.md)" if mistake == "broken-link" else "[gone](faq.md#no-such-section)"
        with (root / "docs" / "faq.md").open("a") as page:
            page.write(f"\nSee {link}.\n")
    built = mkdocs_build(root, tmp_path / "site")
    assert built.returncode != 0
    assert said in built.stdout + built.stderr


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = set(re.findall(r":\s*([\w-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.MULTILINE))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert nav == pages


def test_the_site_and_the_package_name_the_same_addresses():
    assert SITE_URL.startswith("https://") and SITE_URL.endswith("/")
    # A GitHub Pages site of the repository: https://OWNER.github.io/NAME/ for github.com/OWNER/NAME.
    owner, name = REPO_URL.removeprefix("https://github.com/").split("/")
    assert f"https://{owner}.github.io/{name}/" == SITE_URL
    urls = PROJECT["urls"]
    assert urls["Documentation"] == urls["Homepage"] == SITE_URL
    assert urls["Repository"] == REPO_URL
    assert urls["Changelog"] == f"{SITE_URL}changelog/"
    assert (DOCS / "changelog.md").resolve() == (REPO / "CHANGELOG.md").resolve()


def readme_links(text: str) -> list[str]:
    """The targets of ``[text](target)`` and ``<https://...>`` links."""
    return re.findall(r"\]\(([^)]+)\)", text) + re.findall(r"<(https?://[^>]+)>", text)


def link_problems(text: str) -> list[str]:
    """The README's links that would not work on the package index or do not resolve."""
    problems = []
    for link in readme_links(text):
        if not link.startswith("https://"):
            # On the package index a relative link leads nowhere (or to the index's own pages).
            problems.append(f"{link}: not absolute")
        elif link.startswith(SITE_URL):
            page = link.removeprefix(SITE_URL).partition("#")[0]
            # A page's directory URL, as mkdocs serves it, of a page in docs/.
            if not re.fullmatch(r"([\w-]+/)?", page) or not (DOCS / f"{page.rstrip('/') or 'index'}.md").is_file():
                problems.append(f"{link}: no such page in docs/")
        elif link.startswith(f"{REPO_URL}/blob/main/") and \
                not (REPO / link.removeprefix(f"{REPO_URL}/blob/main/")).is_file():
            problems.append(f"{link}: no such file in the repository")
    return problems


def test_the_readme_is_a_landing_page_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 170
    links = readme_links(text)
    assert {f"{SITE_URL}getting-started/", f"{SITE_URL}changelog/", f"{REPO_URL}/blob/main/LICENSE"} <= set(links)
    assert link_problems(text) == []


@pytest.mark.parametrize(("link", "said"), [
    ("docs/faq.md", "docs/faq.md: not absolute"),
    ("CHANGELOG.md", "CHANGELOG.md: not absolute"),
    ("https://kproxy-kafka.github.io/kproxy/no-such-page/", "no such page in docs/"),
    ("https://kproxy-kafka.github.io/kproxy/faq.md", "no such page in docs/"),
    ("https://github.com/kproxy-kafka/kproxy/blob/main/NOTICE", "no such file in the repository"),
])
def test_the_readme_link_check_refuses_a_broken_link(link: str, said: str):
    link = link.replace("https://kproxy-kafka.github.io/kproxy/", SITE_URL).replace(
        "https://github.com/kproxy-kafka/kproxy", REPO_URL)
    (problem,) = link_problems(f"See [this]({link}).\n")
    assert problem.endswith(said), problem


def test_the_home_page_is_the_readme_pointing_into_the_site():
    readme = README.read_text()
    home = (DOCS / "index.md").read_text()
    body = home.split("\n", 1)[1] if home.startswith("<!--") else home
    as_site = re.sub(r"\*\*Documentation:\*\*.*?\n\n", "", readme, flags=re.DOTALL)
    # https://SITE/page/#anchor -> page.md#anchor: a link mkdocs --strict checks, page and anchor.
    as_site = re.sub(re.escape(SITE_URL) + r"([\w-]+)/(#[\w-]+)?\)", lambda m: f"{m[1]}.md{m[2] or ''})", as_site)
    assert body == as_site
    assert SITE_URL not in body
