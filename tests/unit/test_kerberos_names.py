"""Kafka's ``sasl.kerberos.principal.to.local.rules`` as kproxy reads them (kproxy.identity.kerberos),
checked against the examples of Kafka's documentation and of its own KerberosNameTest, and against
the rules Kafka refuses."""

from __future__ import annotations

import pytest

from kproxy.identity.kerberos import KerberosMapper, KerberosName, parse_kerberos_rules
from kproxy.identity.principal import MappingRuleError


def short(rules: list[str], principal: str, realm: str = "REALM.COM") -> str | None:
    return KerberosMapper.from_config(rules, realm).map(principal)[0]


def test_the_documented_example_keeps_the_user_and_the_default_rule():
    # Kafka's security docs: translate user@MYDOMAIN.COM to user while keeping the default rule.
    rules = ["RULE:[1:$1@$0](.*@MYDOMAIN.COM)s/@.*//,DEFAULT"]
    assert short(rules, "user@MYDOMAIN.COM", "EXAMPLE.COM") == "user"
    assert short(rules, "alice@EXAMPLE.COM", "EXAMPLE.COM") == "alice"
    assert short(rules, "alice/admin@EXAMPLE.COM", "EXAMPLE.COM") == "alice"     # DEFAULT: first component
    assert short(rules, "bob@OTHER.ORG", "EXAMPLE.COM") is None                # no rule applies
    # KIP-203's example: the case of the input is kept unless /L or /U says otherwise.
    assert short(["RULE:[2:$1@$0](.*@EXAMPLE.COM)s/@.*//"], "Joe-QA/host@EXAMPLE.COM") == "Joe-QA"
    assert short(["RULE:[2:$1@$0](.*@EXAMPLE.COM)s/@.*///L"], "Joe-QA/host@EXAMPLE.COM") == "joe-qa"


def test_kafka_name_test_parse():
    rules = ["RULE:[1:$1](App\\..*)s/App\\.(.*)/$1/g", "RULE:[2:$1](App\\..*)s/App\\.(.*)/$1/g", "DEFAULT"]
    name = KerberosName.parse("App.service-name/example.com@REALM.COM")
    assert (name.primary, name.instance, name.realm) == ("App.service-name", "example.com", "REALM.COM")
    assert short(rules, "App.service-name/example.com@REALM.COM") == "service-name"
    assert short(rules, "App.service-name@REALM.COM") == "service-name"
    assert short(rules, "user/host@REALM.COM") == "user"


@pytest.mark.parametrize(("case", "expected"), [
    ("L", ["user", "test", "xyz_user_xyz", "service-name", "user"]),
    ("U", ["USER", "TEST", "XYZ_USER_XYZ", "SERVICE-NAME", "USER"]),
])
def test_kafka_name_test_lower_and_upper_case(case: str, expected: list[str]):
    rules = [f"RULE:[1:$1]/{case}", f"RULE:[2:$1](Test.*)s/ABC///{case}", f"RULE:[2:$1](ABC.*)s/ABC/XYZ/g/{case}",
             f"RULE:[2:$1](App\\..*)s/App\\.(.*)/$1/g/{case}", f"RULE:[2:$1]/{case}", "DEFAULT"]
    names = ["User@REALM.COM", "TestABC/host@FOO.COM", "ABC_User_ABC/host@FOO.COM",
             "App.SERVICE-name/example.com@REALM.COM", "User/root@REALM.COM"]
    assert [short(rules, n) for n in names] == expected


@pytest.mark.parametrize("rule", [
    "default", "DEFAUL", "DEFAULT/L", "DEFAULT/g", "rule:[1:$1]", "rule:[1:$1]/L/U", "rule:[1:$1]/U/L",
    "rule:[1:$1]/LU", "RULE:[1:$1/L", "RULE:[1:$1]/l", "RULE:[2:$1](ABC.*)s/ABC/XYZ/L/g",
    # Not in Kafka's test, refused here at once rather than at the first login as Kafka does:
    "RULE:[1:$2]", "RULE:[1:$]", "RULE:[0:$0]", "RULE:[1:$1](App(.*)", "", "RULE:[1:$1]s/(/x/",
])
def test_kafka_invalid_rules_are_refused_naming_the_entry(rule: str):
    with pytest.raises(MappingRuleError) as e:
        parse_kerberos_rules(["DEFAULT", rule])
    assert e.value.index == 1


def test_substitution_replaces_the_first_match_unless_g():
    assert short(["RULE:[1:$1]s/a/x/"], "banana@R", "R") == "bxnana"
    assert short(["RULE:[1:$1]s/a/x/g"], "banana@R", "R") == "bxnxnx"
    # The format builds the string the filter must match whole; $0 is the realm.
    assert short(["RULE:[2:$2.$1.$0](.*\\.svc\\.R)s/\\..*//"], "svc/web@R", "R") == "web"
    assert short(["RULE:[2:$2.$1.$0](svc\\..*)"], "svc/web@R", "R") is None


def test_a_rule_that_leaves_a_slash_or_at_sign_refuses_the_login():
    mapper = KerberosMapper.from_config(["RULE:[1:$1@$0]", "DEFAULT"], "R")
    name, why = mapper.map("alice@R")
    assert name is None and "not a simple name" in why
    name, why = mapper.map("a/b/c@R")            # three components: not a Kafka principal
    assert name is None and "primary[/instance]@REALM" in why


def test_the_first_rule_that_applies_wins_and_default_needs_the_realm():
    mapper = KerberosMapper.from_config(["RULE:[1:$1@$0](.*@PARTNER.ORG)s/(.*)@.*/partner-$1/", "DEFAULT"],
                                        "EXAMPLE.COM")
    assert mapper.map("acme@PARTNER.ORG") == ("partner-acme", "RULE:[1:$1@$0](.*@PARTNER.ORG)s/(.*)@.*/partner-$1/")
    assert mapper.map("alice@EXAMPLE.COM") == ("alice", "DEFAULT")
    name, why = mapper.map("eve@ELSEWHERE.NET")
    assert name is None and "DEFAULT takes only principals of EXAMPLE.COM" in why


def test_several_rules_in_one_entry_and_several_entries_read_alike():
    one = parse_kerberos_rules(["RULE:[1:$1@$0](.*@A.COM)s/@.*//, RULE:[2:$1]/L ,DEFAULT"])
    three = parse_kerberos_rules(["RULE:[1:$1@$0](.*@A.COM)s/@.*//", "RULE:[2:$1]/L", "DEFAULT"])
    assert [r.text for r in one] == [r.text for r in three]
    assert len(one) == 3
