"""Read and build the ``records`` field of Produce requests and Fetch responses: RecordBatch v2 and the
legacy v0/v1 message sets, with their checksums and compression codecs. Parsing is lazy and zero-copy
over the received buffer; nothing here may allocate more than the bytes it was given or, once
decompressed, the caller's cap.

- ``view``: reading a records field (batches, legacy messages, records, iteration, a header-only
  summary) and the formats' constants;
- ``compression``: the codecs, bounded by the caller's cap;
- ``rewrite``: a received batch rebuilt for record rules (same codec and producer fields, new
  records, CRC32C again), header edits, records split and joined again with new keys or values
  (encryption, masking), and a batch carried under another producer id (a switch);
- ``build``: batches encoded from values (kproxy's own records for fleet quota coordination, tests,
  benchmarks, broker stand-ins).
"""

from kproxy.protocol.records.build import build_batch, build_legacy
from kproxy.protocol.records.compression import Compression
from kproxy.protocol.records.rewrite import (
    TRACEPARENT,
    HeaderEdit,
    edit_headers,
    join_records,
    rebuild_batch,
    rebuild_reserved,
    split_records,
    with_producer,
)
from kproxy.protocol.records.view import (
    DEFAULT_MAX_DECOMPRESSED_BYTES,
    LOG_OVERHEAD,
    MAGIC_OFFSET,
    V2_HEADER_SIZE,
    BatchIterator,
    Header,
    LegacyMessage,
    Record,
    RecordBatch,
    RecordsSummary,
    TimestampType,
    iter_batches,
    summarize,
)

__all__ = [
    "DEFAULT_MAX_DECOMPRESSED_BYTES",
    "LOG_OVERHEAD",
    "MAGIC_OFFSET",
    "TRACEPARENT",
    "V2_HEADER_SIZE",
    "BatchIterator",
    "Compression",
    "Header",
    "HeaderEdit",
    "LegacyMessage",
    "Record",
    "RecordBatch",
    "RecordsSummary",
    "TimestampType",
    "build_batch",
    "build_legacy",
    "edit_headers",
    "iter_batches",
    "join_records",
    "rebuild_batch",
    "rebuild_reserved",
    "split_records",
    "summarize",
    "with_producer",
]
