"""What a session asks the I/O layer to do: the actions it returns, in order, for the server's one
executor to carry out (``kproxy.server.executor``). An action that finishes requests carries their
completed entries (``InFlight``). Sans-I/O: buffers and decisions only.
"""

from __future__ import annotations

import struct
from typing import Any

from kproxy.proxy.inflight import InFlight

_I32 = struct.Struct(">i")


def size_prefixed(frame: Any) -> list:
    """The buffers that send ``frame`` with its 4-byte size prefix."""
    return [_I32.pack(len(frame)), frame]


class Action:
    """Something the I/O layer must do, in order."""

    __slots__ = ()


class ToUpstream(Action):
    """Write ``buffers`` to the broker. ``entry`` is the request they carry (None for raw SASL
    tokens); the I/O layer stamps its ``forwarded_at`` and, for an acks=0 Produce, completes it."""

    __slots__ = ("buffers", "entry")

    def __init__(self, buffers: list, entry: InFlight | None = None) -> None:
        self.buffers = buffers
        self.entry = entry

    def __repr__(self) -> str:
        return f"ToUpstream({sum(len(b) for b in self.buffers)} bytes)"


class StreamUp(Action):
    """Write the next ``buffers`` of a request that goes to the broker while it arrives (cut-through,
    ``Session.request_piece``). ``first``: the I/O layer takes the broker write lock (connecting if
    need be) and keeps it until ``last``, so no other bytes come between the frame's pieces. The
    pieces are views of the client's receive chunk: written before it is refilled."""

    __slots__ = ("buffers", "entry", "first", "last")

    def __init__(self, buffers: list, entry: InFlight, first: bool, last: bool) -> None:
        self.buffers = buffers
        self.entry = entry
        self.first = first
        self.last = last

    def __repr__(self) -> str:
        return (f"StreamUp({sum(len(b) for b in self.buffers)} bytes"
                f"{', first' if self.first else ''}{', last' if self.last else ''})")


class ToClient(Action):
    """Write ``buffers`` to the client; the requests in ``done`` are complete once they are written."""

    __slots__ = ("buffers", "done")

    def __init__(self, buffers: list, done: tuple[InFlight, ...] = ()) -> None:
        self.buffers = buffers
        self.done = done

    def __repr__(self) -> str:
        return f"ToClient({sum(len(b) for b in self.buffers)} bytes, {len(self.done)} done)"


class Hold(Action):
    """Wait this long before doing the actions that follow (throttling, filter delays)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"Hold({self.seconds:.3f}s)"


class Listen(Action):
    """Open these broker ports before doing what follows: the next write names them to the client."""

    __slots__ = ("ports",)

    def __init__(self, ports: tuple[int, ...]) -> None:
        self.ports = ports

    def __repr__(self) -> str:
        return f"Listen({', '.join(map(str, self.ports))})"


class Ask(Action):
    """Send ``buffers``, a question a filter asks the broker before it decides, then read nothing more
    from the client until the session has the answer (``Session.asking`` is None again); if none
    comes within the request timeout, tell the session with ``question_unanswered``."""

    __slots__ = ("buffers",)

    def __init__(self, buffers: list) -> None:
        self.buffers = buffers

    def __repr__(self) -> str:
        return f"Ask({sum(len(b) for b in self.buffers)} bytes)"


class Keys(Action):
    """Ask the key service ``question`` (a filter's ``AskKeys``) within the request timeout, reading
    nothing more meanwhile from the side that asked, then carry out the actions ``then(answer)``
    returns. The answer is the service's (``KeyService.answer``), or None when none came in time."""

    __slots__ = ("question", "then")

    def __init__(self, question: Any, then: Any) -> None:
        self.question = question
        self.then = then

    def __repr__(self) -> str:
        return f"Keys({self.question!r})"


class Close(Action):
    """Close the client connection, logging ``reason``; the requests in ``done`` end with it
    (answered with the closed connection, as a broker does when it cannot answer). ``undecodable``
    is "request" or "response" when a frame from that side could not be decoded (for metrics)."""

    __slots__ = ("done", "reason", "undecodable")

    def __init__(self, reason: str, done: tuple[InFlight, ...] = (), undecodable: str | None = None) -> None:
        self.reason = reason
        self.done = done
        self.undecodable = undecodable

    def __repr__(self) -> str:
        return f"Close({self.reason!r})"
