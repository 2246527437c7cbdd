"""`kproxy run` argument handling: quick mode and config files become the right settings; --version,
settings mistakes as one line and exit 2, the refused mix of --config with quick-mode options, and
the wiring of config, logging and server."""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path

import pytest

import kproxy.server.main
from kproxy import cli
from kproxy.config import ConfigError, HostPort
from kproxy.server.app import ProxyServer
from kproxy.server.main import config_for_run


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, root_logger: logging.Logger) -> list:
    seen: list = []
    # Capture the server instead of running it.
    monkeypatch.setattr(kproxy.server.main.trio, "run", lambda fn, server: seen.append(server))
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


MINIMAL = 'listen: "127.0.0.1:19092"\nupstream:\n  bootstrap_servers: ["kafka:9092"]\n'


@pytest.fixture
def config_file(tmp_path: Path) -> str:
    path = tmp_path / "kproxy.yaml"
    path.write_text(MINIMAL)
    return str(path)


def test_version_comes_from_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"kproxy {metadata.version('kproxy-kafka')}\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--log-level", "verbose"],
         "kproxy run: log_level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL; got 'VERBOSE'\n"),
        (["--log-format", "xml"], "kproxy run: log_format: must be one of text, json; got 'xml'\n"),
    ],
)
@pytest.mark.parametrize("mode", ["file", "quick"])
def test_a_bad_log_option_is_one_line_and_exit_2(
        capsys: pytest.CaptureFixture[str], config_file: str, argv: list[str], message: str, mode: str) -> None:
    where = ["--config", config_file] if mode == "file" else ["--upstream", "k:1", "--listen", "127.0.0.1:19092"]
    assert cli.main(["run", *where, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == message


def test_quick_mode_options_next_to_a_config_file_are_refused(
        capsys: pytest.CaptureFixture[str], config_file: str) -> None:
    assert cli.main(["run", "--config", config_file, "--upstream", "k:1", "--listen", "0.0.0.0:9092"]) == 2
    assert capsys.readouterr().err == (
        f"kproxy run: --upstream and --listen cannot be combined with --config; set "
        f"upstream.bootstrap_servers and listen in {config_file}\n")
    assert cli.main(["run", "-c", config_file, "--advertised-host", "kp"]) == 2
    assert "--advertised-host cannot be combined with --config; set exposure.advertised_host in" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("argv", [[], ["--upstream", "k:1"]])
def test_run_needs_a_file_or_both_addresses(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert cli.main(["run", *argv]) == 2
    assert capsys.readouterr().err == (
        "kproxy run: give --config FILE, or --upstream HOST:PORT and --listen HOST:PORT\n")


def test_a_broken_file_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(MINIMAL + "mode: sidekick\n")
    assert cli.main(["run", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"kproxy run: {path}:4: mode: must be one of gateway, sidecar; got 'sidekick' (did you mean 'sidecar'?)\n")


def test_log_options_override_the_file(config_file: str) -> None:
    args = cli._build_parser().parse_args(["run", "-c", config_file, "--log-level", "debug", "--log-format", "json"])
    cfg = config_for_run(args)
    assert (cfg.log_level, cfg.log_format, cfg.source) == ("DEBUG", "json", config_file)
    plain = config_for_run(cli._build_parser().parse_args(["run", "-c", config_file]))
    assert (plain.log_level, plain.log_format) == ("INFO", "text")


def test_quick_mode_takes_the_log_options() -> None:
    args = cli._build_parser().parse_args(["run", "--upstream", "k:1", "--listen", "0.0.0.0:9092",
                                       "--advertised-host", "kp", "--log-format", "JSON"])
    cfg = config_for_run(args)
    assert cfg.listen == HostPort("0.0.0.0", 9092) and cfg.advertised_host == "kp"
    assert cfg.log_format == "json"
    with pytest.raises(ConfigError, match=r"clients cannot connect to 0\.0\.0\.0"):
        config_for_run(cli._build_parser().parse_args(["run", "--upstream", "k:1", "--listen", "0.0.0.0:9092"]))


def test_run_configures_logging_logs_the_settings_and_serves(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], config_file: str,
        root_logger: logging.Logger) -> None:
    served: list[ProxyServer] = []

    async def serve(server: ProxyServer) -> None:
        served.append(server)

    monkeypatch.setattr(kproxy.server.main, "serve_until_signal", serve)
    assert cli.main(["run", "-c", config_file, "--log-format", "json"]) == 0
    (server,) = served
    assert server.config.log_format == "json" and server.config.source == config_file
    (line,) = capsys.readouterr().err.splitlines()
    entry = json.loads(line)
    assert (entry["level"], entry["logger"]) == ("INFO", "kproxy.server")
    assert entry["msg"].startswith(f"kproxy {metadata.version('kproxy-kafka')}: listen 127.0.0.1:19092 -> upstream kafka:9092;")
    assert "idle timeout 600s" in entry["msg"] and "logs INFO as json" in entry["msg"]


def test_quick_mode_telemetry_options(started: list, tmp_path) -> None:
    assert cli.main(["run", "--upstream", "kafka:9092", "--listen", "127.0.0.1:9092", "--admin", "127.0.0.1:9644",
                     "--traffic-log", str(tmp_path), "--tracing"]) == 0
    cfg = started[0].config
    assert cfg.admin.listen == HostPort("127.0.0.1", 9644)
    assert cfg.traffic_log.dir == str(tmp_path) and cfg.tracing.enabled


@pytest.mark.parametrize("option", [["--admin", "127.0.0.1:9644"], ["--traffic-log", "/tmp/x"], ["--tracing"]])
def test_telemetry_options_are_quick_mode_only(option: list[str], started: list, tmp_path, capsys) -> None:
    f = tmp_path / "kproxy.yaml"
    f.write_text(MINIMAL)
    assert cli.main(["run", "--config", str(f), *option]) == 2
    assert "cannot be combined with --config" in capsys.readouterr().err
