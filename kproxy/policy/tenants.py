"""A tenant prefix (``rewrite: topic_prefix`` and the like): the names a request carries get it, the
names of an answer lose it or are hidden, through the one prefix mechanism of ``kproxy.proxy.names``
(a replica cluster's topic prefix is the other user); and the requests a prefix cannot keep inside
the tenant's namespace (ACL changes, name patterns), which are refused. Pure.
"""

from __future__ import annotations

from typing import Any

from kproxy.policy.engine import CACHE_LIMIT, CREATE_ACLS, DELETE_ACLS
from kproxy.policy.model import Rewrite
from kproxy.protocol.errors import CLUSTER_AUTHORIZATION_FAILED
from kproxy.protocol.messages import Request, body_class
from kproxy.proxy.filters import Respond
from kproxy.proxy.names import NamePrefixes, prefixes_of, uses_patterns
from kproxy.proxy.names import pattern_fields as pattern_fields  # imported from here before it moved

INVALID_REGULAR_EXPRESSION = 128

# A tenant's names: the prefixes of one rewrite rule.
TenantNames = NamePrefixes
tenant_of = prefixes_of

_BY_REWRITE: dict[int, tuple[Rewrite, TenantNames]] = {}


def tenant_of_rewrite(rewrite: Rewrite) -> TenantNames:
    got = _BY_REWRITE.get(id(rewrite))
    if got is None or got[0] is not rewrite:
        if len(_BY_REWRITE) >= CACHE_LIMIT:
            _BY_REWRITE.clear()
        got = _BY_REWRITE[id(rewrite)] = (rewrite, tenant_of(rewrite.prefixes()))
    return got[1]


def tenant_refusal(req: Request) -> Respond | None:
    """The answer to a request a tenant prefix cannot keep inside the tenant's namespace, or None."""
    if req.api_key in (CREATE_ACLS, DELETE_ACLS):
        # Wildcards, null filters and the ANY type would reach other tenants' resources. One result
        # per creation or filter, as the broker gives.
        message = "kproxy: ACLs cannot be changed by a client with a tenant prefix"
        cls: Any = body_class(req.api_key, "response")
        if req.api_key == CREATE_ACLS:
            body = cls(results=[cls.AclCreationResult(error_code=CLUSTER_AUTHORIZATION_FAILED, error_message=message)
                                for _ in req.body.creations])
        else:
            body = cls(filter_results=[cls.DeleteAclsFilterResult(error_code=CLUSTER_AUTHORIZATION_FAILED,
                                                                  error_message=message)
                                       for _ in req.body.filters])
        return Respond(body=body)
    if uses_patterns(req):
        return Respond(error_code=INVALID_REGULAR_EXPRESSION,
                       error_message="kproxy: name patterns cannot be used with a tenant prefix; subscribe "
                                     "by topic names, or match them in the client")
    return None
