"""What sealing and opening record values costs on one core, without sockets or a KMS.

Run from the repository root:  ``.venv/bin/python bench/envelope.py [--rounds N] [--quick]``

- **seal** / **open**: a batch's 1 KiB values (random bytes) through ``kproxy.envelope.seal`` and
  ``open_values`` with one DEK, for batches of 16 records (a 16 KiB producer batch) and 1,000 records
  (about 1 MiB); the key-bound variant binds each value to a 16-byte record key. Goal from issue 28:
  at least 150 MB/s of plaintext each, per core.
- **seal batch** / **open batch**: what the data path does to a produced or fetched batch of 1,000
  records of 1 KiB (null keys, as the through-kproxy bench produces them): records in, a rebuilt
  batch out (``kproxy.policy.crypto.seal_partition``/``open_partition``: the records parsed, each
  value sealed or opened, the batch written again with its CRC), through the C accelerator, and
  through the Python reference it falls back to where the accelerator is not built.
- **AES-GCM alone**: the same values through ``AESGCM.encrypt``/``decrypt`` in a bare loop with a fixed
  nonce and associated data: the floor the envelope's own per-record work adds to.
- **size**: the envelope's bytes per record, and what a batch of sealed values weighs after lz4 and
  zstd against the plain batch (sealed values do not compress; their shared headers do).

Figures are MB of plaintext per CPU second of this process (``time.process_time``): the median over
rounds, with the lowest and highest round beside it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import cramjam
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from records import throughput

from kproxy.envelope import Binding, DataKey, KeyRef, Kms, open_values, seal
from kproxy.envelope import records as envelope_records
from kproxy.policy import crypto
from kproxy.protocol.records import build_batch

VALUE_SIZE = 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, short measurements")
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    seconds = 0.2 if args.quick else 1.0

    # A wrapped DEK the size of Vault Transit's in kproxy's compact form (a form byte, the key version, 60 raw bytes).
    ref = KeyRef(Kms.VAULT_TRANSIT, "payments-kek", os.urandom(62))
    dek = DataKey(ref, os.urandom(32))
    binding = Binding("payments-eu")
    deks = {ref: dek}
    cases: dict[str, Callable[[], float]] = {}
    for count in (16, 1000):
        values = [os.urandom(VALUE_SIZE) for _ in range(count)]
        keys = [os.urandom(16) for _ in range(count)]
        sealed = seal(dek, values, binding)
        bound = seal(dek, values, binding, keys)
        views = [memoryview(v) for v in sealed]   # as a batch's records hand them out
        assert open_values(views, binding, deks)[0] == values
        assert open_values(bound, binding, deks, keys)[0] == values
        size = VALUE_SIZE * count
        cases[f"seal, {count} records/batch"] = (
            lambda v=values, s=size: throughput(lambda: seal(dek, v, binding), s, seconds))
        cases[f"open, {count} records/batch"] = (
            lambda v=views, s=size: throughput(lambda: open_values(v, binding, deks), s, seconds))
        cases[f"seal key-bound, {count} records/batch"] = (
            lambda v=values, k=keys, s=size: throughput(lambda: seal(dek, v, binding, k), s, seconds))
        cases[f"open key-bound, {count} records/batch"] = (
            lambda v=bound, k=keys, s=size: throughput(lambda: open_values(v, binding, deks, k), s, seconds))

    batch_values = [os.urandom(VALUE_SIZE // 2).hex().encode() for _ in range(1000)]
    produced = crypto.sealable_batches(build_batch([(None, v) for v in batch_values]))
    fetched = crypto.seal_partition(produced, "payments-eu", crypto.Grants([(dek, 1 << 40)]), False, 1 << 26)[0]
    assert crypto.open_partition(crypto.read_fetched(fetched, 1 << 26), "payments-eu", deks, (), None,
                                 1 << 26) == produced[0].raw

    def seal_batch() -> None:
        crypto.seal_partition(produced, "payments-eu", crypto.Grants([(dek, 1 << 40)]), False, 1 << 26)

    def open_batch() -> None:
        crypto.open_partition(crypto.read_fetched(fetched, 1 << 26), "payments-eu", deks, (), None, 1 << 26)

    def reference(run: Callable[[], None]) -> Callable[[], None]:
        def in_python() -> None:
            native = envelope_records._native_seal, envelope_records._native_open
            envelope_records._native_seal = envelope_records._native_open = None
            try:
                run()
            finally:
                envelope_records._native_seal, envelope_records._native_open = native
        return in_python

    size = VALUE_SIZE * 1000
    accel = envelope_records._native_seal is not None
    for name, run in (("seal batch", seal_batch), ("open batch", open_batch)):
        if accel:
            cases[f"{name}, 1000 records, accelerator"] = lambda r=run: throughput(r, size, seconds)
        cases[f"{name}, 1000 records, Python reference"] = lambda r=run: throughput(reference(r), size, seconds)

    aes = AESGCM(os.urandom(32))
    nonce, aad = os.urandom(12), os.urandom(100)
    bare = [os.urandom(VALUE_SIZE) for _ in range(1000)]
    bare_sealed = [aes.encrypt(nonce, v, aad) for v in bare]

    def bare_encrypt() -> None:
        for v in bare:
            aes.encrypt(nonce, v, aad)

    def bare_decrypt() -> None:
        for v in bare_sealed:
            aes.decrypt(nonce, v, aad)

    cases["AES-GCM encrypt alone, 1000 values"] = lambda: throughput(bare_encrypt, VALUE_SIZE * 1000, seconds)
    cases["AES-GCM decrypt alone, 1000 values"] = lambda: throughput(bare_decrypt, VALUE_SIZE * 1000, seconds)

    results: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(rounds):
        order = list(cases.items())
        random.Random(r).shuffle(order)
        for name, run in order:
            results[name].append(run())

    print(f"bench/envelope.py: {rounds} rounds, 1 KiB values; MB of plaintext per CPU second "
          f"(median, [lowest - highest])")
    for name, figures in results.items():
        print(f"  {name:40} {statistics.median(figures):8.1f} MB/s  [{min(figures):.1f} - {max(figures):.1f}]")

    # Sizes: text of 64 symbols compresses about 1.3x as plain values; sealed ones not at all.
    rng = random.Random(0)
    alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,"
    text = [bytes(rng.choices(alphabet, k=VALUE_SIZE)) for _ in range(1000)]
    sealed_text = seal(dek, text, binding)
    overhead = len(sealed_text[0]) - VALUE_SIZE
    plain_cat, sealed_cat = b"".join(text), b"".join(sealed_text)
    print(f"size: {overhead} bytes of envelope per value ({overhead / VALUE_SIZE:.1%} of 1 KiB; KEK name "
          f"{len(ref.kek)} bytes, wrapped DEK {len(ref.wrapped)} bytes)")
    for codec, compress in (("lz4", cramjam.lz4.compress_block), ("zstd", cramjam.zstd.compress)):
        p, s = len(bytes(compress(plain_cat))), len(bytes(compress(sealed_cat)))
        print(f"  1000 values, {codec}: plain {p / 1e3:.0f} kB, sealed {s / 1e3:.0f} kB "
              f"({s / len(plain_cat) - 1:+.1%} against the uncompressed plain values)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
