"""Client certificates to principals: Kafka's ssl.principal.mapping.rules semantics (the examples of
Kafka's security documentation), RFC 2253 subjects, SPIFFE IDs, and config errors naming the rule."""

from __future__ import annotations

import pytest

from kproxy.config import ConfigError, parse_config
from kproxy.identity.principal import MappingRuleError, PrincipalMapper, distinguished_name, parse_rules

# The rules of Kafka's documentation (docs/security.html, "Customizing SSL User Name"), one string
# as Kafka's property holds them.
KAFKA_DOC_RULES = ("RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/,"
                   "RULE:^CN=(.*?),OU=(.*?),O=(.*?),L=(.*?),ST=(.*?),C=(.*?)$/$1@$2/L,"
                   "RULE:^.*[Cc][Nn]=([a-zA-Z0-9.]*).*$/$1/L,"
                   "DEFAULT")


def cert(*rdns: tuple[str, str], uris: tuple[str, ...] = ()) -> dict:
    """A getpeercert() dict; ``rdns`` most significant first, as in the certificate."""
    return {"subject": tuple(((k, v),) for k, v in rdns),
            "subjectAltName": (*tuple(("URI", u) for u in uris), ("DNS", "client.example"))}


def name_of(rules: str | list[str], subject: str) -> str | None:
    mapped = parse_rules([rules] if isinstance(rules, str) else rules)
    for rule in mapped:
        got = rule.apply(subject)
        if got is not None:
            return got
    return None


@pytest.mark.parametrize(("subject", "expected"), [
    ("CN=serviceuser,OU=ServiceUsers,O=Unknown,L=Unknown,ST=Unknown,C=Unknown", "serviceuser"),
    ("CN=adminUser,OU=Admin,O=Unknown,L=Unknown,ST=Unknown,C=Unknown", "adminuser@admin"),
    ("CN=kafka1.Example.com,O=Acme", "kafka1.example.com"),      # only the third rule matches
    ("OU=JustAnOU,O=Acme", "OU=JustAnOU,O=Acme"),                # DEFAULT
])
def test_kafka_documented_rules(subject: str, expected: str) -> None:
    assert name_of(KAFKA_DOC_RULES, subject) == expected


def test_upper_case_and_list_form() -> None:
    rules = ["RULE:^CN=(.*?),OU=(.*?),O=(.*?),L=(.*?),ST=(.*?),C=(.*?)$/$1@$2/U", "DEFAULT"]
    assert name_of(rules, "CN=adminUser,OU=Admin,O=Unknown,L=Unknown,ST=Unknown,C=Unknown") == "ADMINUSER@ADMIN"


def test_first_matching_rule_wins_and_no_match_is_none() -> None:
    rules = ["RULE:^CN=(.*)$/first-$1/", "RULE:^CN=(.*)$/second-$1/"]
    assert name_of(rules, "CN=a") == "first-a"
    # The pattern must match the whole subject (Java's Matcher.matches), not a part of it.
    assert name_of(["RULE:CN=a/x/"], "CN=a,O=b") is None
    mapper = PrincipalMapper.from_config(["RULE:^CN=(.*),O=Acme$/$1/"], san_uri=False)
    assert mapper.map(cert(("organizationName", "Other"), ("commonName", "eve")))[0] is None
    assert "no tls.principal.mapping_rules rule matches 'CN=eve,O=Other'" in mapper.map(
        cert(("organizationName", "Other"), ("commonName", "eve")))[1]
    assert mapper.map(cert(("organizationName", "Acme"), ("commonName", "alice"))) == (
        "alice", "RULE:^CN=(.*),O=Acme$/$1/")


def test_replacement_syntax_follows_java() -> None:
    # A group the pattern lacks stays literal text (as Kafka escapes it); \ quotes the next character.
    assert name_of("RULE:^CN=(.*?),O=(.*)$/$1@$3/", "CN=a,O=b") == "a@$3"
    assert name_of("RULE:^CN=(.*?),O=(.*)$/$12/", "CN=a,O=b") == "a2"
    assert name_of(r"RULE:^CN=(.*?),O=(.*)$/\$1-$2/", "CN=a,O=b") == "$1-b"
    assert name_of("RULE:^CN=(?<user>[^,]*),.*$/${user}/", "CN=bob,O=x") == "bob"
    # An escaped slash belongs to the pattern.
    assert name_of(r"RULE:^CN=([^\/]*)\/(.*)$/$2/", "CN=a/b") == "b"
    # Java's replaceAll: ".*" also matches the empty string at the end, so it substitutes twice.
    assert name_of("RULE:.*/x/", "CN=a") == "xx"


@pytest.mark.parametrize(("rule", "problem"), [
    ("RULE:^CN=(.*$/$1/", "bad regular expression"),
    ("RULE:^CN=.*$/$1/X", "cannot read"),
    ("RULE:^CN=.*$", "cannot read"),
    ("DEFAULTS", "cannot read"),
    ("  ", "an empty rule"),
])
def test_bad_rules_are_refused(rule: str, problem: str) -> None:
    with pytest.raises(MappingRuleError, match=problem) as e:
        parse_rules(["DEFAULT", rule])
    assert e.value.index == 1


def test_distinguished_name_is_rfc2253() -> None:
    c = {"subject": ((("countryName", "US"),), (("organizationName", "Acme, Inc."),),
                     (("organizationalUnitName", "A+B"), ("organizationalUnitName", "C")),
                     (("commonName", " #lead"),), (("emailAddress", "a@b.example"),))}
    assert distinguished_name(c) == r"emailAddress=a@b.example,CN=\ #lead,OU=A\+B+OU=C,O=Acme\, Inc.,C=US"
    assert distinguished_name({"subject": ()}) is None


def test_spiffe_id_from_the_uri_san() -> None:
    mapper = PrincipalMapper.from_config(["DEFAULT"], san_uri=True)
    spiffe = "spiffe://example.org/ns/payments/sa/api"
    assert mapper.map(cert(("commonName", "api"), uris=(spiffe,))) == (spiffe, "URI SAN")
    name, why = mapper.map(cert(("commonName", "api")))
    assert name is None and "0 URI SANs" in why
    name, why = mapper.map(cert(("commonName", "api"), uris=(spiffe, "spiffe://example.org/other")))
    assert name is None and "2 URI SANs" in why


BASE = 'listen: "127.0.0.1:9092"\nupstream:\n  bootstrap_servers: ["kafka:9093"]\n'


def test_config_error_names_the_rule_and_its_line(tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    text = BASE + (f"tls:\n  ca_file: {ca}\n  principal:\n    mapping_rules:\n"
                   "      - DEFAULT\n      - \"RULE:^CN=([^,]+,.*$/$1/\"\n")
    with pytest.raises(ConfigError) as e:
        parse_config(text, "kproxy.yaml")
    message = str(e.value)
    assert message.startswith("kproxy.yaml:9: tls.principal.mapping_rules[1]: rule 'RULE:^CN=([^,]+,.*$/$1/'")
    assert "bad regular expression" in message


def test_config_principal_needs_client_certificates() -> None:
    with pytest.raises(ConfigError, match=r"tls\.principal: maps client certificates, which need tls\.ca_file"):
        parse_config(BASE + "tls:\n  principal: {san_uri: true}\n", "kproxy.yaml")
    with pytest.raises(ConfigError, match=r"tls\.principal\.san_uri: takes the URI SAN as it is"):
        parse_config(BASE + "tls:\n  ca_file: kproxy.yaml\n  principal: {san_uri: true, mapping_rules: [\"RULE:a/b/\"]}\n",
                     "kproxy.yaml")
