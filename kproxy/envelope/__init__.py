"""Record encryption's pure half: the envelope a sealed record value or key carries (``format``),
sealing and opening a batch's values with AES-256-GCM (``aead``), and a whole records section in
one pass, in the C accelerator where it was built (``records``), and the DEK lifetime, cache and
KMS-call policy (``keys``). Nothing here does I/O or reads a clock: keys, bytes and the time are
handed in; the KMS clients that fetch and unwrap DEKs are ``kproxy.kms``.
"""

from kproxy.envelope.aead import DataKey, open_values, seal
from kproxy.envelope.format import (
    MAGIC,
    Binding,
    EnvelopeError,
    KeyRef,
    Kms,
    MissingDataKey,
    Part,
    TamperedRecord,
    UnknownEnvelope,
    bound_topic,
    describe,
    is_sealed,
    key_refs,
    parse_header,
)
from kproxy.envelope.keys import Calls, KeyPolicy, KeyRing, UnwrapCache

__all__ = [
    "MAGIC",
    "Binding",
    "Calls",
    "DataKey",
    "EnvelopeError",
    "KeyPolicy",
    "KeyRef",
    "KeyRing",
    "Kms",
    "MissingDataKey",
    "Part",
    "TamperedRecord",
    "UnknownEnvelope",
    "UnwrapCache",
    "bound_topic",
    "describe",
    "is_sealed",
    "key_refs",
    "open_values",
    "parse_header",
    "seal",
]
