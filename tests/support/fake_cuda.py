"""The CuPy half of the CPU stand-in (:mod:`nccl_fake` installs it): devices, streams,
events and arrays.

Arrays are NumPy arrays of a subclass (:class:`FakeArray`) that carries a device id,
``.data.ptr`` (the real host address) and ``.get()``. Array work issued while a stream is
current runs on the host once the NCCL calls launched earlier on that stream have run
(CUDA's stream order); an Event recorded on a stream is done once the calls issued on it
before have run. Only the API the NCCL backend is documented to use exists, so a call CuPy
lacks fails loudly.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import types
from typing import Any

import numpy as np


class FakeMisuse(AssertionError):
    """The backend called the fake in a way real CuPy/NCCL would not accept."""


class Settings:
    """Knobs a test may turn."""

    def __init__(self, device_count: int, version_code: int) -> None:
        self.device_count = device_count
        self.version_code = version_code
        self.hang_events = False  # events never complete (to test timeouts)
        self.async_error: int | None = None  # check_async_error raises this status
        self.calls: list[tuple[str, int]] = []  # (NCCL call, rank) in posting order
        self.aborted: list[int] = []  # ranks whose communicators were aborted, in order
        self.match_timeout = 20.0
        # CuPy 14 passes the unique id as 128 bytes; earlier CuPy as 128 signed chars.
        self.tuple_unique_id = False
        #: The 16-byte UUID each device reports (device id -> bytes); by default each
        #: device its own.
        self.uuids: dict[int, bytes] = {}
        #: What the backend asked of CUDA: "device enter" (a ``with Device(...)``),
        #: "event record", "stream query" (``Stream.done``), "event query" (``Event.done``).
        self.counts: collections.Counter[str] = collections.Counter()


SETTINGS = Settings(4, 21903)
_local = threading.local()


def _count(what: str) -> None:
    SETTINGS.counts[what] += 1
    _local.__dict__.setdefault("counts", collections.Counter())[what] += 1


def thread_counts() -> collections.Counter[str]:
    """:attr:`Settings.counts` of the calling thread alone (a copy)."""
    return collections.Counter(getattr(_local, "counts", ()))
_ptr_counter = itertools.count(0x1000)


# --- devices, streams, events ------------------------------------------------------------

def current_device() -> int:
    stack = getattr(_local, "devices", None)
    return stack[-1] if stack else getattr(_local, "base_device", 0)


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = current_device() if device is None else int(device)
        if not 0 <= self.id < SETTINGS.device_count:
            raise FakeMisuse(f"fake cupy: no device {self.id}")

    def __enter__(self) -> Device:
        _count("device enter")
        _local.__dict__.setdefault("devices", []).append(self.id)
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.devices.pop()

    def use(self) -> None:
        _local.base_device = self.id

    def synchronize(self) -> None:
        pass


class Stream:
    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        self.ptr = 0 if null else next(_ptr_counter)
        self.device_id = current_device()

    def __enter__(self) -> Stream:
        _local.__dict__.setdefault("streams", []).append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.streams.pop()

    def synchronize(self) -> None:
        _stream_order(self)

    @property
    def done(self) -> bool:
        """Whether the NCCL calls launched on this stream so far have all run."""
        _count("stream query")
        return not SETTINGS.hang_events and not _pending_on(self.ptr)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, Event):
            raise FakeMisuse("Stream.wait_event needs an Event")

    def record(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event


_STREAMS: dict[int, Stream] = {}


def _register(stream: Stream) -> Stream:
    _STREAMS[stream.ptr] = stream
    return stream


def get_current_stream(device_id: int = -1) -> Stream:
    streams = getattr(_local, "streams", None)
    if streams:
        return streams[-1]
    return Stream(null=True)


_PENDING: dict[int, list[Any]] = collections.defaultdict(list)  # stream ptr -> NCCL ops
_PENDING_LOCK = threading.Lock()


def _pending_on(ptr: int) -> list[Any]:
    """The NCCL calls launched (posted, not merely queued in a group) on a stream, not done."""
    with _PENDING_LOCK:
        ops = [o for o in _PENDING[ptr] if not o.done.is_set()]
        _PENDING[ptr] = ops
        return [o for o in ops if o.posted]


def _stream_order(stream: Stream | None = None) -> None:
    """Array work on ``stream`` (the current one) starts after its earlier NCCL calls."""
    stream = stream or get_current_stream()
    if stream.ptr:
        for op in _pending_on(stream.ptr):
            op.wait()


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self.ops: list[Any] = []

    def record(self, stream: Stream | None = None) -> None:
        _count("event record")
        self.ops = _pending_on((stream or get_current_stream()).ptr)

    @property
    def done(self) -> bool:
        _count("event query")
        return not SETTINGS.hang_events and all(o.done.is_set() for o in self.ops)

    def synchronize(self) -> None:
        if SETTINGS.hang_events:
            raise FakeMisuse("Event.synchronize would hang forever (the backend must poll)")
        for op in self.ops:
            op.wait()


# --- arrays ------------------------------------------------------------------------------

class FakeArray(np.ndarray):
    """A NumPy array pretending to live on a GPU."""

    def __array_finalize__(self, obj: Any) -> None:
        dev = getattr(obj, "_dev", None)
        self._dev = current_device() if dev is None else dev

    @property
    def data(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.ctypes.data, device_id=self._dev)

    @property
    def device(self) -> Device:  # type: ignore[override]
        return Device(self._dev)

    def get(self, stream: Stream | None = None, order: str = "C", out: Any = None,
            blocking: bool = True) -> np.ndarray:
        _stream_order(stream)
        if out is None:
            return np.array(self.view(np.ndarray), copy=True)
        if isinstance(out, FakeArray) or not isinstance(out, np.ndarray) or \
                out.shape != self.shape or out.dtype != self.dtype or \
                not out.flags.c_contiguous:
            raise FakeMisuse("get(out=): out must be a C-contiguous NumPy array of the same "
                             "shape and dtype")
        out[...] = self.view(np.ndarray)
        return out

    def set(self, arr: Any, stream: Stream | None = None) -> None:
        _stream_order(stream)
        if isinstance(arr, FakeArray) or not isinstance(arr, np.ndarray) or \
                arr.shape != self.shape or arr.dtype != self.dtype:
            raise FakeMisuse("set(arr): arr must be a NumPy array of the same shape and dtype")
        self.view(np.ndarray)[...] = arr

    def __setitem__(self, key: Any, value: Any) -> None:
        _stream_order()
        super().__setitem__(key, value)

    # Real CuPy refuses NumPy operands in its ufuncs and array functions ("TypeError:
    # Unsupported type <class 'numpy.ndarray'>", seen on an H100); so does the fake,
    # else a NumPy subclass would quietly compute on a mix of host and device arrays.
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out", ())
        _refuse_host_operands(f"{ufunc.__name__}.{method}", [*inputs, *out])
        if out:
            kwargs["out"] = tuple(_plain(o) for o in out)
        result = getattr(ufunc, method)(*(_plain(a) for a in inputs), **kwargs)
        if out:
            return out[0] if len(out) == 1 else out
        return _to_fake_tree(result)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        _refuse_host_operands(f"numpy.{func.__name__}", [*args, *kwargs.values()])
        return _to_fake_tree(func(*_plain(list(args)), **{k: _plain(v)
                                                          for k, v in kwargs.items()}))


def _host_arrays_in(values: Any) -> bool:
    for v in values:
        if isinstance(v, (list, tuple)):
            if _host_arrays_in(v):
                return True
        elif isinstance(v, np.ndarray) and not isinstance(v, FakeArray) and v.ndim > 0:
            return True
    return False


def _refuse_host_operands(what: str, operands: list[Any]) -> None:
    if _host_arrays_in(operands):
        raise TypeError(f"fake cupy: {what} was given a NumPy array among CuPy arrays "
                        "(real CuPy: Unsupported type <class 'numpy.ndarray'>)")


def _plain(a: Any) -> Any:
    if isinstance(a, FakeArray):
        return a.view(np.ndarray)
    if isinstance(a, (list, tuple)):
        return type(a)(_plain(x) for x in a)
    return a


def _to_fake_tree(r: Any) -> Any:
    """Results as CuPy gives them: arrays on the device, 0-d ones too (NumPy gives scalars)."""
    if isinstance(r, (tuple, list)):
        return type(r)(_to_fake_tree(x) for x in r)
    if isinstance(r, np.generic):
        return np.asarray(r).view(FakeArray)
    return _to_fake(r)


def _to_fake(x: Any) -> Any:
    if isinstance(x, np.ndarray) and not isinstance(x, FakeArray):
        return x.view(FakeArray)
    return x


class FakeCupy(types.ModuleType):
    """``cupy``: array creation makes FakeArrays; other names fall back to NumPy."""

    ndarray = FakeArray

    def asarray(self, a: Any, dtype: Any = None, order: Any = None) -> FakeArray:
        if isinstance(a, FakeArray) and (dtype is None or a.dtype == dtype):
            return a
        _stream_order()
        return _to_fake(np.array(np.asarray(a), dtype=dtype, copy=True))

    def array(self, a: Any, dtype: Any = None, copy: bool = True, **kw: Any) -> FakeArray:
        _stream_order()
        return _to_fake(np.array(np.asarray(a), dtype=dtype, copy=True))

    def asnumpy(self, a: Any, stream: Any = None) -> np.ndarray:
        _stream_order(stream)
        return np.array(np.asarray(a).view(np.ndarray), copy=True)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        target = getattr(np, name)
        if callable(target) and not isinstance(target, type):
            @functools.wraps(target)
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                _stream_order()
                return _to_fake(target(*args, **kwargs))
            return wrapped
        return target

