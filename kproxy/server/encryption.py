"""Record encryption's wiring: the process's key service from the ``kms:`` section, the view of its
data keys the policy filter reads (``RecordCrypto``), and the check that the KEKs encrypt rules name
exist in the KMS (at start, on every reload, and in ``kproxy check``). The envelope is
``kproxy.envelope``'s, the KMS calls ``kproxy.kms``'s.
"""

from __future__ import annotations

import logging
from typing import Any

from kproxy.config import ConfigError, ProxyConfig
from kproxy.kms.backends import open_client
from kproxy.kms.client import KmsError
from kproxy.kms.service import KeyService
from kproxy.policy.crypto import RecordCrypto
from kproxy.policy.model import Encrypt, RuleSet

log = logging.getLogger("kproxy.kms")


def open_key_service(config: ProxyConfig) -> tuple[KeyService, RecordCrypto] | None:
    """The key service and the filter's view of it, or None without a ``kms:`` section."""
    kms = config.kms
    if kms is None:
        return None
    if kms.local is not None:
        log.warning("kms: KEKs come from the local key file %s: FOR DEVELOPMENT ONLY (anyone who reads it "
                    "can open every record); use vault, aws or pkcs11 in production", kms.local.file)
    service = KeyService(open_client(kms.client_settings()), kms.key_policy())
    return service, RecordCrypto(service.ring, service.cache, service.clock)


def encrypt_without_kms(config: ProxyConfig, rule_set: RuleSet) -> ConfigError | None:
    """An encrypt rule in a configuration without a ``kms:`` section, at the rule's file and line."""
    if config.kms is not None:
        return None
    for r in rule_set.rules:
        if r.action == "encrypt":
            where = r.where
            return ConfigError(f"rule {r.name!r} encrypts records, but the configuration has no kms: section "
                               "naming the KMS that holds its KEK", file=where.file if where else None,
                               line=where.line if where else None)
    return None


async def kek_problems(service: KeyService, rule_set: RuleSet) -> tuple[list[ConfigError], list[str]]:
    """``(errors, warnings)`` about the KEKs the encrypt rules name: an error (at the rule's file
    and line) for a KEK the KMS does not have, a warning when the KMS could not be asked. KEK
    names with ``${topic}`` are checked when a topic first uses them."""
    wanted: dict[str, Any] = {}
    for r in rule_set.rules:
        if r.action == "encrypt" and isinstance(r.params, Encrypt) and "${" not in r.params.kek:
            wanted.setdefault(r.params.kek, r)
    if not wanted:
        return [], []
    results = await service.check_keks(wanted)
    errors: list[ConfigError] = []
    warnings: list[str] = []
    for kek, problem in results.items():
        if problem is None:
            continue
        rule = wanted[kek]
        where = rule.where
        if isinstance(problem, KmsError) and problem.retriable:
            warnings.append(f"rule {rule.name!r}: could not check KEK {kek!r} ({problem})")
        else:
            errors.append(ConfigError(f"encrypt.kek: rule {rule.name!r} names KEK {kek!r}: {problem}",
                                      file=where.file if where else None, line=where.line if where else None))
    return errors, warnings
