"""`kproxy run` argument handling: quick mode and config files become the right settings."""

from __future__ import annotations

import pytest

from kproxy import cli
from kproxy.server import app


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list:
    seen: list = []
    # Capture the server instead of running it.
    monkeypatch.setattr(app.trio, "run", lambda fn, server: seen.append(server))
    return seen


def test_quick_mode_with_advertised_host(started: list) -> None:
    assert cli.main(["run", "--upstream", "kafka:9092", "--listen", "0.0.0.0:9092",
                     "--advertised-host", "kp.local"]) == 0
    cfg = started[0].config
    assert (cfg.advertised_host, cfg.listen.port, cfg.broker_port_start) == ("kp.local", 9092, 9093)
    assert [str(b) for b in cfg.upstream.bootstrap_servers] == ["kafka:9092"]


def test_quick_mode_on_a_wildcard_address_needs_an_advertised_host(started: list,
                                                                   capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["run", "--upstream", "kafka:9092", "--listen", "0.0.0.0:9092"]) == 2
    assert "advertised_host" in capsys.readouterr().err
    assert started == []


def test_config_file_errors_name_file_and_line(tmp_path, started: list, capsys) -> None:
    f = tmp_path / "kproxy.yaml"
    f.write_text('listen: "127.0.0.1:9092"\nupstream:\n  bootstrap_servers: ["b:9092"]\nlimits:\n  max_frame_sise: 5\n')
    assert cli.main(["run", "--config", str(f)]) == 2
    assert f"{f}:5:" in capsys.readouterr().err
    assert started == []


def test_run_without_upstream_or_config_is_refused(started: list, capsys) -> None:
    assert cli.main(["run", "--listen", "127.0.0.1:9092"]) == 2
    assert "--upstream" in capsys.readouterr().err
