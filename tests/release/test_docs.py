"""The documentation site: ``mkdocs build --strict`` over mkdocs.yml and docs/ passes, and the same
build fails on a page left out of the nav and on a broken link or anchor (so the check can fail).
README.md is a landing page whose links all resolve, and docs/index.md is the README with its
links pointing into the site."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"


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


def test_the_readme_is_a_landing_page_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 170
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert "docs/getting-started.md" in links
    for link in links:
        if not link.startswith("http"):
            assert (REPO / link).is_file(), link


def test_the_home_page_is_the_readme_pointing_into_the_site():
    readme = README.read_text()
    home = (DOCS / "index.md").read_text()
    body = home.split("\n", 1)[1] if home.startswith("<!--") else home
    as_site = re.sub(r"\*\*Documentation:\*\*.*?\n\n", "", readme, flags=re.DOTALL)
    as_site = as_site.replace("](docs/", "](").replace("[CHANGELOG.md](CHANGELOG.md)", "[changelog](changelog.md)")
    assert body == as_site
