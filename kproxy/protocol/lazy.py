"""Arrays of structs that stay bytes until a filter looks at them.

A ``LazyArray`` is created by a generated decoder after a validating pass over the array's bytes, so
decoding its elements later cannot fail. It behaves like a list; until its first element is read it
is only the received bytes, which the encoder re-emits as a view of the input (zero copy). It must not
outlive the frame it views, like the records fields do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableSequence
from typing import Any, SupportsIndex, overload

from kproxy.protocol.errors import DecodeError


class LazyArray(MutableSequence):
    """A list of structs decoded on first access from bytes that were already validated.

    ``len()`` is known without decoding. Any other read or change decodes every element once, after
    which it is a plain list inside. Until then the encoder writes ``raw`` (count prefix included)
    unchanged, when it belongs to the same message version (``decoder`` tells).
    """

    __slots__ = ("_buf", "_dec", "_end", "_items", "_n", "_pos", "_sp", "_start")

    def __init__(self, buf: memoryview, start: int, pos: int, end: int, n: int,
                 decoder: Callable[..., list[Any]], spans: dict[int, int]) -> None:
        self._buf = buf          # the frame
        self._start = start      # the array's first byte (its count)
        self._pos = pos          # the first element's first byte
        self._end = end          # one past the last element
        self._n = n
        self._dec = decoder      # (buf, pos, end, n, spans) -> (elements, position after them)
        self._sp = spans         # nested array spans found by the validating pass, shared per frame
        self._items: list[Any] | None = None

    # -- the bytes, for the encoder

    @property
    def decoded(self) -> bool:
        """True once the elements exist as objects (then the encoder encodes them)."""
        return self._items is not None

    @property
    def raw(self) -> memoryview:
        """The array as received, count prefix included."""
        return self._buf[self._start:self._end]

    def _load(self) -> list[Any]:
        items = self._items
        if items is None:
            try:
                items, _ = self._dec(self._buf, self._pos, self._end, self._n, self._sp)
            except Exception as e:  # pragma: no cover - the validating pass makes this unreachable
                raise DecodeError(f"lazy array failed after validation: {type(e).__name__}: {e}",
                                  self._start) from e
            self._items = items
            self._buf = self._sp = None  # type: ignore[assignment]  # the frame is no longer needed
        return items

    # -- the list protocol

    def __len__(self) -> int:
        items = self._items
        return self._n if items is None else len(items)

    @overload
    def __getitem__(self, index: SupportsIndex) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: Any) -> Any:
        return self._load()[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self._load()[index] = value

    def __delitem__(self, index: Any) -> None:
        del self._load()[index]

    def insert(self, index: int, value: Any) -> None:
        self._load().insert(index, value)

    def append(self, value: Any) -> None:
        self._load().append(value)

    def extend(self, values: Iterable[Any]) -> None:
        self._load().extend(values)

    def pop(self, index: int = -1) -> Any:
        return self._load().pop(index)

    def remove(self, value: Any) -> None:
        self._load().remove(value)

    def clear(self) -> None:
        self._items = []
        self._buf = self._sp = None  # type: ignore[assignment]

    def reverse(self) -> None:
        self._load().reverse()

    def sort(self, *, key: Callable[[Any], Any] | None = None, reverse: bool = False) -> None:
        self._load().sort(key=key, reverse=reverse)

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        items = self._load()
        return items.index(value, start) if stop is None else items.index(value, start, stop)

    def count(self, value: Any) -> int:
        return self._load().count(value)

    def copy(self) -> list[Any]:
        return list(self._load())

    def __iter__(self) -> Iterator[Any]:
        return iter(self._load())

    def __reversed__(self) -> Iterator[Any]:
        return reversed(self._load())

    def __contains__(self, value: object) -> bool:
        return value in self._load()

    def __iadd__(self, values: Iterable[Any]) -> LazyArray:
        self._load().extend(values)
        return self

    def __add__(self, other: Iterable[Any]) -> list[Any]:
        return self._load() + list(other)

    def __radd__(self, other: Iterable[Any]) -> list[Any]:
        return list(other) + self._load()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyArray):
            if (self._items is None and other._items is None and self._dec is other._dec
                    and self.raw == other.raw):
                return True
            return self._load() == other._load()
        if isinstance(other, list):
            return self._load() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return repr(self._load())
