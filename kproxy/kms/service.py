"""The process's data keys: the pure ``KeyRing`` (DEKs that seal) and ``UnwrapCache`` (DEKs that
open), filled by one KMS client. This is the object the connection executor asks when a batch needs
a key the session did not find: ``data_keys`` for sealing, ``unwrap_all`` for opening.

Every KMS call runs in the service's own nursery (``run``), never in a caller's task: a request that
stops waiting (its deadline passed, its client left) does not cancel a call that others wait for.
There is one call per key at a time however many wait (``Calls``), a failed key backs off, and a
caller that finds its key backing off gets the last error at once instead of waiting (a Produce is
answered with a retriable error and the client retries). A timer renews the DEKs of KEKs in use as
they age, so a produce does not wait for a renewal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Final

import trio

from kproxy.envelope.aead import DataKey
from kproxy.envelope.format import KeyRef
from kproxy.envelope.keys import Calls, KeyPolicy, KeyRing, UnwrapCache
from kproxy.kms.client import KmsClient, KmsError
from kproxy.telemetry.metrics import Histogram

log = logging.getLogger("kproxy.kms")

RENEW_TICK_S: Final = 1.0        # how often DEKs of KEKs in use are checked for age
CALL_TIMEOUT_S: Final = 30.0     # a KMS call's own deadline, beyond the client's per-request timeouts

GENERATE: Final = "generate"
UNWRAP: Final = "unwrap"
CHECK: Final = "check"


class _Call:
    """A KMS call in flight: callers wait on ``ended``; ``result`` is its DEK or its error."""

    __slots__ = ("ended", "result")

    def __init__(self) -> None:
        self.ended = trio.Event()
        self.result: DataKey | KmsError | None = None


class KeyService:
    """Data keys for sealing and opening records, from ``kms``; ``run`` must be running."""

    def __init__(self, kms: KmsClient, policy: KeyPolicy | None = None, *,
                 clock: Callable[[], float] = trio.current_time, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.kms = kms
        self.policy = policy = policy or KeyPolicy()
        self.clock = clock
        self.call_timeout_s = call_timeout_s
        self.ring = KeyRing(policy, on_due=self._renew)
        self.cache = UnwrapCache(policy.cache_entries, policy.cache_age_s)
        self.unwraps: Calls[KeyRef] = Calls(policy.backoff_initial_s, policy.backoff_max_s)
        self._calls: dict[Hashable, _Call] = {}
        self._nursery: trio.Nursery | None = None
        # Metrics: calls by (op, outcome), where outcome is "ok" or KmsError.reason; durations by op.
        self.calls: dict[tuple[str, str], int] = {}
        self.durations: dict[str, Histogram] = {}

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run KMS calls and renew aging DEKs until cancelled."""
        log.info("kms: %s; a DEK seals at most %d records for at most %gs", self.kms.describe(),
                 self.policy.max_records, self.policy.max_age_s)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                while True:
                    await trio.sleep(RENEW_TICK_S)
                    now = self.clock()
                    for kek in self.ring.due(now):
                        self._renew(kek)
                    self.ring.forget_idle(now)
        finally:
            self._nursery = None

    # -- sealing

    async def data_keys(self, kek: str, records: int) -> list[tuple[DataKey, int]]:
        """``records`` records on ``kek``'s DEKs (``KeyRing.reserve``'s grants), waiting for the KMS
        if the supply is short. Raises KmsError when the call fails or ``kek`` is backing off; the
        caller bounds the wait with its own deadline (the request's timeout)."""
        while True:
            now = self.clock()
            grants = self.ring.reserve(kek, records, now)   # asks for a renewal itself when short
            if grants is not None:
                return grants
            error = self.ring.error(kek, now)
            if error is not None:
                raise error
            call = self._calls.get((GENERATE, kek)) or self._renew(kek)
            if call is None:
                raise RuntimeError("KeyService.run is not running")
            await call.ended.wait()

    def _renew(self, kek: str) -> _Call | None:
        key = (GENERATE, kek)
        call = self._calls.get(key)
        if call is None and self._nursery is not None and self.ring.start(kek, self.clock()):
            call = self._calls[key] = _Call()
            self._nursery.start_soon(self._generate, kek, call)
        return call

    async def _generate(self, kek: str, call: _Call) -> None:
        try:
            new = await self._timed(GENERATE, self.kms.generate(kek))
            now = self.clock()
            dek = DataKey(KeyRef(self.kms.kind, kek, new.wrapped), new.key, now)
            self.ring.add(kek, dek)
            self.cache.put(dek, now)       # records it seals open here without a KMS call
            call.result = dek
            log.debug("kms: new DEK for KEK %r", kek)
        except KmsError as e:
            now = self.clock()
            retry_at = self.ring.failed(kek, now, e, retriable=e.retriable)
            call.result = e
            log.warning("kms: no DEK for KEK %r: %s (%s; next try in %.1fs)", kek, e,
                        "retriable" if e.retriable else "not retriable", retry_at - now)
        finally:
            self.ring.calls.in_flight.discard(kek)     # also when cancelled
            del self._calls[(GENERATE, kek)]
            call.ended.set()

    # -- opening

    async def unwrap_all(self, refs: Iterable[KeyRef]) -> dict[KeyRef, DataKey | KmsError]:
        """Each reference's DEK from the cache or the KMS, or the KmsError that stands for it (a ref
        that is backing off gets its last error at once). Calls for several refs run together."""
        now = self.clock()
        out: dict[KeyRef, DataKey | KmsError] = {}
        waiting: list[tuple[KeyRef, _Call]] = []
        for ref in refs:
            dek = self.cache.get(ref, now)
            if dek is not None:
                out[ref] = dek
                continue
            if ref.kms != self.kms.kind:
                out[ref] = KmsError("wrong_kms", f"the DEK of KEK {ref.kek!r} was wrapped by another kind of KMS "
                                                 f"(#{ref.kms}) than the one configured ({self.kms.name})",
                                    retriable=False)
                continue
            error = self.unwraps.error(ref, now)
            if isinstance(error, KmsError):
                out[ref] = error
                continue
            call = self._calls.get((UNWRAP, ref))
            if call is None:
                if self._nursery is None:
                    raise RuntimeError("KeyService.run is not running")
                if self.unwraps.start(ref, now):
                    call = self._calls[(UNWRAP, ref)] = _Call()
                    self._nursery.start_soon(self._unwrap, ref, call)
            if call is not None:
                waiting.append((ref, call))
        for ref, call in waiting:
            await call.ended.wait()
            out[ref] = call.result if call.result is not None else KmsError(
                "unreachable", "the unwrap was cancelled", retriable=True)
        return out

    async def _unwrap(self, ref: KeyRef, call: _Call) -> None:
        try:
            key = await self._timed(UNWRAP, self.kms.unwrap(ref.kek, ref.wrapped))
            now = self.clock()
            dek = DataKey(ref, key, now)
            self.cache.put(dek, now)
            self.unwraps.succeeded(ref)
            call.result = dek
        except KmsError as e:
            now = self.clock()
            retry_at = self.unwraps.failed(ref, now, e)
            call.result = e
            log.warning("kms: cannot unwrap a DEK of KEK %r: %s (%s; next try in %.1fs)", ref.kek, e,
                        "retriable" if e.retriable else "not retriable", retry_at - now)
        finally:
            self.unwraps.in_flight.discard(ref)
            del self._calls[(UNWRAP, ref)]
            call.ended.set()

    # -- the sessions' questions (kproxy.policy.crypto.SealKeys / OpenKeys)

    async def answer(self, question: Any) -> dict[Any, Any]:
        """A connection's question: for ``SealKeys``, each KEK's grants or its KmsError; for
        ``OpenKeys``, each reference's DEK or its KmsError."""
        needs = getattr(question, "needs", None)
        if needs is not None:
            out: dict[Any, Any] = {}
            for kek, records in needs:
                try:
                    out[kek] = await self.data_keys(kek, records)
                except KmsError as e:
                    out[kek] = e
            return out
        return dict(await self.unwrap_all(question.refs))

    # -- checks

    async def check_keks(self, keks: Iterable[str]) -> dict[str, KmsError | None]:
        """For start and reload: each KEK name with None if the KMS has it, else why not (an unknown
        KEK is a non-retriable ``unknown_kek``; an unreachable KMS its own error)."""
        out: dict[str, KmsError | None] = {}
        for kek in keks:
            try:
                exists = await self._timed(CHECK, self.kms.kek_exists(kek))
                out[kek] = None if exists else KmsError(
                    "unknown_kek", f"{self.kms.name} has no KEK {kek!r} that can encrypt", retriable=False)
            except KmsError as e:
                out[kek] = e
        return out

    async def _timed(self, op: str, call: Any) -> Any:
        started = self.clock()
        outcome = "ok"
        try:
            with trio.fail_after(self.call_timeout_s):
                return await call
        except trio.TooSlowError:
            outcome = "timeout"
            raise KmsError("timeout", f"{self.kms.name}: no answer within {self.call_timeout_s:g}s",
                           retriable=True) from None
        except KmsError as e:
            outcome = e.reason
            raise
        except Exception as e:
            # A bug or an answer the client did not foresee: the message names the type, not the data.
            outcome = "bad_answer"
            log.error("kms: %s call to %s failed", op, self.kms.name, exc_info=True)
            raise KmsError("bad_answer", f"{self.kms.name}: {op} failed ({type(e).__name__})",
                           retriable=False) from None
        finally:
            key = (op, outcome)
            self.calls[key] = self.calls.get(key, 0) + 1
            hist = self.durations.get(op)
            if hist is None:
                hist = self.durations[op] = Histogram()
            hist.observe(self.clock() - started)

    def snapshot(self) -> dict[str, Any]:
        """What ``kproxy.telemetry.metrics.kms_families`` exports."""
        now = self.clock()
        return {
            "backend": self.kms.name,
            "calls": dict(self.calls),
            "durations": dict(self.durations),
            "cache_hits": self.cache.hits,
            "cache_misses": self.cache.misses,
            "cache_evicted": self.cache.evicted,
            "cache_entries": len(self.cache),
            "deks_generated": self.ring.generated,
            "deks_retired": self.ring.retired,
            "backing_off": self.ring.calls.backing_off(now) + self.unwraps.backing_off(now),
        }
