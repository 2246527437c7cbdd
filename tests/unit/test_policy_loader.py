"""Rule files: what they compile to, and every error naming file, line, column, rule and reason."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import jsonschema
import pytest

from kproxy.cli import main
from kproxy.config import ConfigError
from kproxy.policy import model as M
from kproxy.policy.loader import RuleError, load_rules, rule_files
from kproxy.policy.schema import rules_schema, schema_text

from .rulebook import rule_set, write_rules

REPO = Path(__file__).resolve().parents[2]
RULES_DIR = REPO / "rules"


def problems(tmp_path: Path, text: str) -> list[str]:
    path = write_rules(tmp_path, text, "bad.yaml")
    with pytest.raises(RuleError) as info:
        load_rules([path])
    lines = str(info.value).splitlines()
    assert all(line.startswith(f"{path}:") for line in lines), lines
    return [line[len(path) + 1:] for line in lines]


# -- the published schema ----------------------------------------------------------------------------


def test_published_schema_is_the_one_kproxy_checks_with():
    assert (RULES_DIR / "rules.schema.json").read_text() == schema_text()
    schema = json.loads(schema_text())
    jsonschema.validators.validator_for(schema).check_schema(schema)


def test_every_example_names_the_schema_and_passes_it():
    validator = jsonschema.Draft202012Validator(rules_schema())
    import yaml

    examples = sorted(RULES_DIR.glob("*.yaml"))
    assert {p.name for p in examples} >= {"allow-all.yaml", "multi-tenant.yaml", "read-only-consumers.yaml",
                                          "admin-lockdown.yaml", "producer-standards.yaml", "chaos.yaml"}
    for path in examples:
        text = path.read_text()
        assert text.startswith("# yaml-language-server: $schema=./rules.schema.json\n"), path
        assert list(validator.iter_errors(yaml.safe_load(text) or {})) == [], path
        assert load_rules([str(path)]).sources == (str(path),)


# -- what rules compile to ---------------------------------------------------------------------------


def test_the_contract_example_compiles(tmp_path):
    rs = rule_set(tmp_path, """\
        default: allow
        rules:
          - name: no-secrets
            match: {topic: "secret-*"}
            action: deny
          - name: team-a
            match: {client_id: "team-a-*"}
            action: rewrite
            rewrite: {topic_prefix: "tenant-a.", group_prefix: "tenant-a.", transactional_id_prefix: "tenant-a."}
          - name: admin-lockdown
            match: {api: admin, principal: {not: "User:ops"}}
            action: deny
        quotas: []
        """)
    assert [r.name for r in rs.rules] == ["no-secrets", "team-a", "admin-lockdown"]
    assert rs.default == "allow" and rs.quotas == ()
    no_secrets, team_a, lockdown = rs.rules
    assert no_secrets.match.topic("secret-x") and not no_secrets.match.topic("public")
    assert no_secrets.params == M.Deny(None)
    assert team_a.params == M.Rewrite("tenant-a.", "tenant-a.", "tenant-a.")
    assert lockdown.match.principal("User:alice") and not lockdown.match.principal("User:ops")
    assert 19 in lockdown.match.api.values and 0 not in lockdown.match.api.values
    assert team_a.where == M.Where(rs.sources[0], 6, 5)


def test_selectors_and_actions_compile(tmp_path):
    rs = rule_set(tmp_path, """\
        default: deny
        rules:
          - name: a
            match:
              client_id: [app-1, "re:app-[0-9]+"]
              source: [10.0.0.0/8, "2001:db8::/32", 192.168.1.7]
              listener: "broker-*"
              client_software: {name: librdkafka, version: ">=2.0, <3"}
              api: [produce, 1, read]
              api_version: [3-9, "12+", 1]
              acks: [all, 1]
              compression: {not: none}
              group: g
              transactional_id: {not: ["tx-*"]}
            action: require
            require: {acks: all, max_batch_bytes: 1024, compression: zstd, uncompressed_max_bytes: 64}
          - name: b
            action: cap
            cap: {max_bytes: 1, partition_max_bytes: 2, max_wait_ms: 3, timeout_ms: 4}
          - name: c
            action: chaos
            chaos: {rate: 0.5, latency_ms: {mean: 20}, error: REQUEST_TIMED_OUT}
          - name: d
            action: log
            log: {level: WARNING, sample: 0.25}
          - name: e
            match: {api: {not: [admin]}}
            action: deny
            deny: {error: POLICY_VIOLATION}
        quotas:
          - name: q
            match: {client_id: "x-*", api: produce}
            per: principal
            produce_bytes_per_s: 1000
            request_time_percent: 12.5
            burst_s: 2
        """)
    a, b, c, d, e = rs.rules
    m = a.match
    assert m.client_id("app-77") and m.source("192.168.1.7") and m.source("2001:db8::5")
    assert m.listener("broker-3") and m.client_software("librdkafka", "2.16.0")
    assert m.api.values >= {0, 1, 2, 3} and m.api_version(1) and m.api_version(15) and not m.api_version(10)
    assert m.acks(-1) and m.acks(1) and not m.acks(0)
    assert m.compression(frozenset({4})) and not m.compression(frozenset({0}))
    assert m.transactional_id("other") and not m.transactional_id("tx-1")
    assert a.params == M.Require(-1, 1024, frozenset({4}), 64)
    assert b.params == M.Cap(1, 2, 3, 4)
    assert c.params == M.Chaos(0.5, M.Latency("exponential", 0.02), 7)
    assert d.params == M.Log(30, 0.25)
    assert e.params == M.Deny(44) and 19 not in e.match.api.values and 0 in e.match.api.values
    assert rs.default == "deny"
    (q,) = rs.quotas
    assert q.name == "q" and q.match.client_id("x-1") and q.match.api(0) and not q.match.api(1)
    assert (q.per, q.burst_s, q.limits) == ("principal", 2.0, {"produce_bytes_per_s": 1000.0,
                                                               "request_time_percent": 12.5})


def test_an_empty_file_allows_everything(tmp_path):
    rs = load_rules([write_rules(tmp_path, "")])
    assert rs.rules == () and rs.default == "allow"


def test_a_directory_is_its_yaml_files_in_name_order_without_hidden_entries(tmp_path):
    d = tmp_path / "rules.d"
    d.mkdir()
    write_rules(d, "rules: [{name: second, action: allow}]\n", "20-b.yaml")
    write_rules(d, "rules: [{name: first, action: deny}]\n", "10-a.yaml")
    write_rules(d, "rules: [{name: hidden, action: deny}]\n", ".hidden.yaml")
    (d / "notes.txt").write_text("not rules")
    # A ConfigMap volume: ..data points at a timestamped directory holding the real files.
    (d / "..2024_01_01").mkdir()
    write_rules(d / "..2024_01_01", "rules: [{name: twice, action: deny}]\n", "30-c.yaml")
    rs = load_rules([str(d)])
    assert [r.name for r in rs.rules] == ["first", "second"]
    assert rule_files([str(d)]) == [str(d / "10-a.yaml"), str(d / "20-b.yaml")]


def test_files_combine_in_order_and_share_one_default(tmp_path):
    a = write_rules(tmp_path, "default: deny\nrules: [{name: a, action: allow}]\n")
    b = write_rules(tmp_path, "rules: [{name: b, action: allow}]\n")
    rs = load_rules([b, a])
    assert [r.name for r in rs.rules] == ["b", "a"] and rs.default == "deny" and rs.sources == (b, a)


def test_chaos_rules_load_but_warn_while_chaos_is_off(tmp_path):
    path = write_rules(tmp_path, "rules: [{name: c, action: chaos, chaos: {error: NETWORK_EXCEPTION}}]\n")
    assert "chaos is off" in load_rules([path]).warnings[0]
    assert load_rules([path], chaos=True).warnings == ()


# -- errors --------------------------------------------------------------------------------------------


def test_unknown_selector_action_api_and_error_names_get_did_you_mean(tmp_path):
    assert problems(tmp_path, """\
        rules:
          - name: r1
            match: {topc: x, api: [produse]}
            action: deni
          - name: r2
            action: deny
            deny: {error: TOPIC_AUTHORISATION_FAILED}
        """) == [
        "3:13: rule 'r1': match: unknown selector 'topc' (did you mean 'topic'?)",
        "3:28: rule 'r1': match.api[0]: unknown API name or group 'produse' (did you mean 'produce'?)",
        "4:13: rule 'r1': action: unknown action 'deni' (did you mean 'deny'?)",
        "7:19: rule 'r2': deny.error: unknown Kafka error name 'TOPIC_AUTHORISATION_FAILED' "
        "(did you mean 'TOPIC_AUTHORIZATION_FAILED'?)",
    ]


def test_unknown_keys_without_a_close_match_list_the_known_ones(tmp_path):
    (line,) = problems(tmp_path, "rulez: []\n")
    assert line == "1:1: unknown top-level key 'rulez' (did you mean 'rules'?)"
    (line,) = problems(tmp_path, "rules: [{name: r, action: allow, zzz: 1}]\n")
    assert line.startswith("1:34: rule 'r': unknown key 'zzz' (expected one of: name, match, action")


def test_what_the_schema_cannot_say(tmp_path):
    assert problems(tmp_path, """\
        rules:
          - name: r
            match:
              client_id: "re:(("
              source: [10.0.0.1/8, nonsense]
              api_version: "9-3"
            action: deny
          - name: tenant
            match: {topic: x}
            action: rewrite
            rewrite: {topic_prefix: t.}
            deny: {}
          - name: drill
            action: chaos
            chaos: {error: TOPIC_AUTHORIZATION_FAILED, latency_ms: {min: 9, max: 1}}
          - name: capless
            action: cap
          - name: r
            action: allow
        """) == [
        "4:18: rule 'r': match.client_id: bad regular expression '((': missing ), unterminated subpattern "
        "at position 1",
        "5:16: rule 'r': match.source[0]: '10.0.0.1/8' has host bits set (did you mean '10.0.0.0/8'?)",
        "5:28: rule 'r': match.source[1]: 'nonsense' is not an IP address or CIDR ('nonsense' does not appear "
        "to be an IPv4 or IPv6 network)",
        "6:20: rule 'r': match.api_version: range '9-3' is empty (write 3-9)",
        "9:13: rule 'tenant': match.topic: a rewrite rule cannot select topics: it sets the namespace of "
        "whole requests; select clients instead (client_id, principal, source, listener)",
        "12:5: rule 'tenant': 'deny:' settings do nothing in a rule whose action is rewrite; remove them",
        "15:20: rule 'drill': chaos.error: TOPIC_AUTHORIZATION_FAILED is not retriable, so clients would fail "
        "instead of retrying; chaos injects retriable errors such as NOT_LEADER_OR_FOLLOWER, "
        "REQUEST_TIMED_OUT or NETWORK_EXCEPTION",
        "15:60: rule 'drill': chaos.latency_ms: min 9 is above max 1",
        "16:5: rule 'capless': action cap needs 'cap:' settings",
        "18:11: rule 'r': name: the name 'r' is already used at " f"{tmp_path / 'bad.yaml'}:2:5",
    ]


def test_chaos_latency_above_the_bound_is_refused_with_its_line(tmp_path):
    assert problems(tmp_path, """\
        rules:
          - {name: fixed, action: chaos, chaos: {latency_ms: 60001}}
          - {name: uniform, action: chaos, chaos: {latency_ms: {min: 1, max: 90000}}}
          - {name: exponential, action: chaos, chaos: {latency_ms: {mean: 600000}}}
          - {name: at-the-bound, action: chaos, chaos: {latency_ms: {min: 60000, max: 60000}}}
        """) == [
        "2:54: rule 'fixed': chaos.latency_ms: must be at most 60000, got 60001",
        "3:70: rule 'uniform': chaos.latency_ms.max: must be at most 60000, got 90000",
        "4:67: rule 'exponential': chaos.latency_ms.mean: must be at most 60000, got 600000",
    ]


def test_types_and_shapes(tmp_path):
    assert problems(tmp_path, """\
        default: maybe
        rules:
          - match: {client_id: []}
            action: allow
          - name: r
            match: {acks: 2, api: 99999, client_id: 7}
            action: rewrite
            rewrite: {topic_prefix: "a b"}
          - name: s
            action: chaos
            chaos: {rate: 2}
        """) == [
        "1:10: default: unknown default action 'maybe' (expected one of: allow, deny)",
        "3:5: rules[0]: missing required key 'name'",
        "3:24: rules[0]: match.client_id: needs at least one entry",
        "6:19: rule 'r': match.acks: unknown acks value 2 (expected one of: all, -1, 0, 1)",
        "6:27: rule 'r': match.api: must be at most 32767, got 99999",
        "6:45: rule 'r': match.client_id: expected a string, got 7",
        "8:29: rule 'r': rewrite.topic_prefix: 'a b' may only hold letters, digits, '.', '_' and '-'",
        "11:19: rule 's': chaos.rate: must be at most 1, got 2",
    ]


def test_yaml_mistakes(tmp_path):
    (line,) = problems(tmp_path, "rules:\n  - name: r\n    action: [allow\n")
    assert line.startswith("4:1: YAML syntax error:")
    (line,) = problems(tmp_path, "rules: []\nrules: []\n")
    assert line == "2:1: duplicate key 'rules' (first at line 1)"
    (line,) = problems(tmp_path, "- just a list\n")
    assert line == "1:1: expected a mapping, got a list"


def test_an_api_key_kproxy_does_not_know(tmp_path):
    (line,) = problems(tmp_path, "rules: [{name: r, match: {api: 999}, action: deny}]\n")
    assert line == "1:32: rule 'r': match.api: no Kafka API has key 999"


def test_default_conflicts_and_missing_files_fail_the_whole_load(tmp_path):
    good = write_rules(tmp_path, "default: allow\nrules: [{name: a, action: allow}]\n")
    other = write_rules(tmp_path, "default: deny\n")
    with pytest.raises(RuleError) as info:
        load_rules([good, other, str(tmp_path / "missing.yaml")])
    assert str(info.value).splitlines() == [
        f"{other}:1:10: default: default deny contradicts default allow at {good}:1:10",
        f"{tmp_path / 'missing.yaml'}: cannot read the file: No such file or directory",
    ]
    assert isinstance(info.value, ConfigError) and info.value.line == 1 and info.value.column == 10


# -- the command line ----------------------------------------------------------------------------------


def test_kproxy_check_rules(tmp_path, capsys):
    good = write_rules(tmp_path, "rules: [{name: a, match: {topic: x}, action: deny}]\n")
    assert main(["check", "--rules", good]) == 0
    assert capsys.readouterr().out == f"ok: {good}: 1 rule (1 deny) from 1 file, default allow, chaos off\n"
    bad = write_rules(tmp_path, "rules: [{name: b, action: alow}]\n")
    assert main(["check", "--rules", good, "--rules", bad]) == 2
    err = capsys.readouterr().err
    assert err == f"{bad}:1:27: rule 'b': action: unknown action 'alow' (did you mean 'allow'?)\n"
    assert main(["check"]) == 2
    assert "give a configuration file, or --rules PATH" in capsys.readouterr().err


def test_kproxy_check_config_checks_its_rule_files(tmp_path, capsys):
    d = tmp_path / "conf"
    (d / "rules").mkdir(parents=True)
    write_rules(d / "rules", "rules: [{name: a, action: deny, match: {api: admin}}]\n", "10-a.yaml")
    config = d / "kproxy.yaml"
    config.write_text(textwrap.dedent("""\
        listen: "127.0.0.1:19092"
        upstream: {bootstrap_servers: ["kafka:9092"]}
        rules: [rules]
        """))
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"rules from {d / 'rules'}; rules: 1 rule (1 deny) from 1 file, default allow, "
                        "chaos off\n")
    write_rules(d / "rules", "rules: [{name: a, action: allow}]\n", "20-b.yaml")
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == (f"{d / 'rules' / '20-b.yaml'}:1:16: rule 'a': name: the name 'a' is already used at "
                   f"{d / 'rules' / '10-a.yaml'}:1:9\n")


def test_config_rules_paths_are_relative_to_the_file_and_must_exist(tmp_path):
    from kproxy.config import load_config, parse_config

    (tmp_path / "r.yaml").write_text("")
    config = tmp_path / "kproxy.yaml"
    config.write_text('listen: "127.0.0.1:19092"\nupstream: {bootstrap_servers: ["k:9092"]}\nrules: r.yaml\n'
                      "chaos: true\n")
    cfg = load_config(config)
    assert cfg.rules == (str(tmp_path / "r.yaml"),) and cfg.chaos is True
    config.write_text('listen: "127.0.0.1:19092"\nupstream: {bootstrap_servers: ["k:9092"]}\n'
                      "rules: [r.yaml, gone.yaml]\n")
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value) == f"{config}:3: rules[1]: not found: {tmp_path / 'gone.yaml'}"
    with pytest.raises(ConfigError) as info:
        parse_config(f'listen: "127.0.0.1:19092"\nupstream: {{bootstrap_servers: ["k:9092"]}}\n'
                     f"rules: [{tmp_path / 'r.yaml'}]\npassthrough_unknown_versions: true\n")
    assert "would bypass the policy rules" in str(info.value)


def test_quick_mode_takes_repeatable_rules(tmp_path):
    from kproxy.cli import _build_parser
    from kproxy.server.main import config_for_run

    a = write_rules(tmp_path, "")
    b = write_rules(tmp_path, "")
    args = _build_parser().parse_args(["run", "--upstream", "k:9092", "--listen", "127.0.0.1:19092",
                                       "--rules", a, "--rules", b, "--chaos"])
    cfg = config_for_run(args)
    assert cfg.rules == (a, b) and cfg.chaos
    args = _build_parser().parse_args(["run", "--config", os.devnull, "--rules", a])
    with pytest.raises(ConfigError, match="--rules cannot be combined with --config"):
        config_for_run(args)


def test_aliases_cannot_make_a_small_file_enormous(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
              f"*a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
    (line,) = problems(tmp_path, "\n".join(lines) + "\n")
    assert "more than 200,000 values (through YAML aliases?)" in line
