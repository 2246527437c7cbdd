"""Live reload of rule files: what counts as a change (ConfigMap symlink swaps included), and the
watcher reloading on it, with trio's autojump clock instead of real waiting."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from kproxy.policy.store import RuleStore
from kproxy.server.reload import fingerprint, watch_rules

RULES_V1 = "rules: [{name: one, action: deny}]\n"
RULES_V2 = "rules: [{name: one, action: deny}, {name: two, action: allow}]\n"


def configmap(root: Path, text: str) -> Path:
    """A directory laid out as kubelet mounts a ConfigMap: rules.yaml -> ..data/rules.yaml, ..data ->
    ..<timestamp>/, the real file inside."""
    root.mkdir(exist_ok=True)
    version = root / "..2024_01_01_00_00_00.1"
    version.mkdir()
    (version / "rules.yaml").write_text(text)
    (root / "..data").symlink_to(version.name)
    (root / "rules.yaml").symlink_to("..data/rules.yaml")
    return root


def swap(root: Path, text: str, n: int) -> None:
    """Update the ConfigMap as kubelet does: a new timestamped directory, then one atomic rename of
    a fresh ..data symlink over the old one."""
    version = root / f"..2024_01_01_00_00_0{n}.1"
    version.mkdir()
    (version / "rules.yaml").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(version.name)
    os.replace(tmp, root / "..data")


def test_a_configmap_swap_changes_the_fingerprint_of_the_file_and_the_directory(tmp_path):
    root = configmap(tmp_path / "cm", RULES_V1)
    as_file = (str(root / "rules.yaml"),)
    as_dir = (str(root),)
    before = fingerprint(as_file), fingerprint(as_dir)
    assert before == (fingerprint(as_file), fingerprint(as_dir))    # nothing changed: same
    swap(root, RULES_V1, 2)                                          # same text, new files
    assert fingerprint(as_file) != before[0] and fingerprint(as_dir) != before[1]


def test_edits_new_files_and_removals_change_the_fingerprint(tmp_path):
    d = tmp_path / "rules.d"
    d.mkdir()
    f = d / "a.yaml"
    f.write_text(RULES_V1)
    paths = (str(d),)
    seen = [fingerprint(paths)]
    f.write_text(RULES_V2)                      # in place: size and time
    seen.append(fingerprint(paths))
    (d / "b.yaml").write_text("")               # a new file
    seen.append(fingerprint(paths))
    (d / "b.yaml").unlink()
    seen.append(fingerprint(paths))
    tmp = d / ".a.yaml.swp"                     # an editor's atomic save
    tmp.write_text(RULES_V1)
    os.replace(tmp, f)
    seen.append(fingerprint(paths))
    assert len(set(seen)) == len(seen)
    assert fingerprint((str(tmp_path / "missing.yaml"),)) == ((str(tmp_path / "missing.yaml"), None),) * 2


async def test_the_watcher_reloads_changes_and_keeps_the_old_rules_on_a_bad_edit(tmp_path, autojump_clock):
    root = configmap(tmp_path / "cm", RULES_V1)
    store = RuleStore([str(root)])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_rules, store, 1.0)
        await trio.sleep(2.5)
        assert (store.generation, store.reloads_ok) == (1, 0)          # nothing changed, nothing loaded
        swap(root, RULES_V2, 2)
        await trio.sleep(1.5)
        assert (store.generation, store.rule_count, store.reloads_ok) == (2, 2, 1)
        swap(root, "rules: [{name: broken, action: nope}]\n", 3)
        await trio.sleep(1.5)
        assert (store.generation, store.rule_count, store.reloads_failed) == (2, 2, 1)
        assert "unknown action 'nope'" in (store.last_error or "")
        await trio.sleep(3)
        assert store.reloads_failed == 1                               # tried once per change
        swap(root, RULES_V1, 4)
        await trio.sleep(1.5)
        assert (store.generation, store.rule_count, store.last_error) == (3, 1, None)
        nursery.cancel_scope.cancel()
