"""The array layer: the only module that knows about NumPy, CuPy and DLPack.

Everything else in axondist asks this module for the namespace of an array
(``xp = namespace(x)``) and then calls only ``xp.*``. Detection never imports
CuPy: a CuPy array can only exist if ``cupy`` is already in ``sys.modules``.

Arrays of other frameworks (PyTorch, JAX, ...) come in through DLPack with
:func:`as_array`, which shares memory with the producer where the producer
allows it (:mod:`axondist._frameworks` knows torch's and JAX's particulars).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod
from types import ModuleType
from typing import Any

import numpy as np

from ._frameworks import framework_of
from .errors import InvalidBufferError, UnsupportedDTypeError

#: The dtypes every backend accepts that NumPy itself defines, in the order they are documented.
_NUMPY_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d)
    for d in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool",
              "complex64", "complex128")
)
#: The names of every dtype a backend accepts: NumPy's, then bfloat16 (ml_dtypes' NumPy
#: extension, imported on first use: a bfloat16 array exists only once ml_dtypes is loaded,
#: so a job without one never pays for the import).
SUPPORTED_DTYPE_NAMES: tuple[str, ...] = tuple(d.name for d in _NUMPY_DTYPES) + ("bfloat16",)
#: The 2-byte floating-point dtypes, by name: their means are computed in float32.
HALF_PRECISION = frozenset(("float16", "bfloat16"))

# np.dtype instances have one class per dtype (numpy.dtypes.Float32DType, ...), so
# checking the class is a cheap exact test on the per-call hot path (bfloat16's class
# joins when ml_dtypes is first loaded).
_SUPPORTED_DTYPE_CLASSES = {type(d) for d in _NUMPY_DTYPES}


@functools.cache
def bfloat16_dtype() -> np.dtype:
    """ml_dtypes' bfloat16 as ``np.dtype``, imported on the first call."""
    from ml_dtypes import bfloat16

    dtype = np.dtype(bfloat16)
    _SUPPORTED_DTYPE_CLASSES.add(type(dtype))
    return dtype


def __getattr__(name: str) -> Any:
    """``bfloat16`` and ``SUPPORTED_DTYPES`` (all of them, bfloat16 last), which load ml_dtypes."""
    if name == "bfloat16":
        return bfloat16_dtype()
    if name == "SUPPORTED_DTYPES":
        return _NUMPY_DTYPES + (bfloat16_dtype(),)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_supported_dtype(dtype: np.dtype) -> bool:
    """True when every backend can communicate ``dtype`` (never imports ml_dtypes)."""
    return dtype in _NUMPY_DTYPES or dtype.name == "bfloat16"


_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3
_DLPACK_CUDA_MANAGED = 13


def _cupy() -> ModuleType | None:
    """CuPy if the user already imported it, else None (never imports it)."""
    return sys.modules.get("cupy")


def is_cupy(x: Any) -> bool:
    """True when ``x`` is a CuPy ndarray."""
    cp = _cupy()
    return cp is not None and isinstance(x, cp.ndarray)


def namespace(*arrays: Any) -> ModuleType:
    """The array module (``numpy`` or ``cupy``) of ``arrays``.

    Raises:
        TypeError: when NumPy and CuPy arrays are mixed.
    """
    if len(arrays) == 1 and type(arrays[0]) is np.ndarray:  # the common case, kept cheap
        return np
    found = {("cupy" if is_cupy(a) else "numpy") for a in arrays if a is not None}
    if len(found) > 1:
        raise TypeError(
            "arrays mix NumPy (host) and CuPy (device) memory; move them to one place "
            "first with axondist.to_host(...) or axondist.to_device(...)"
        )
    if found == {"cupy"}:
        return _cupy()  # type: ignore[return-value]
    return np


def as_array(x: Any) -> Any:
    """Return ``x`` as a NumPy or CuPy array, sharing memory where possible.

    NumPy and CuPy arrays pass through unchanged. Objects that speak DLPack
    (``torch.Tensor``, ``jax.Array``, ...) are imported without a copy: to NumPy
    when they live on the CPU, to CuPy when they live on a CUDA device. A torch
    tensor that requires grad gives its data (``detach()``), a bfloat16 tensor
    crosses as its bits; JAX arrays give read-only views. Python scalars and
    sequences become NumPy arrays.

    Raises:
        UnsupportedDTypeError: a torch or JAX dtype with no NumPy/CuPy counterpart.
    """
    if isinstance(x, np.ndarray) or is_cupy(x):
        return x
    framework = framework_of(x)
    if framework is not None:
        return framework.array(x, "as_array")
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = int(x.__dlpack_device__()[0])
        if device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            return np.from_dlpack(x)
        if device_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
            import cupy  # the producer is on a GPU, so CuPy is required

            return cupy.from_dlpack(x)
        raise TypeError(f"as_array: DLPack device type {device_type} is not supported "
                        "(CPU and CUDA are)")
    if hasattr(x, "__cuda_array_interface__"):
        import cupy

        return cupy.asarray(x)
    return np.asarray(x)


def to_host(x: Any) -> np.ndarray:
    """A NumPy array with the values of ``x`` (no copy when already on the host)."""
    x = as_array(x)
    if is_cupy(x):
        return x.get()
    return x


def host_staging_buffer(x: Any) -> np.ndarray:
    """An uninitialized host array shaped like ``x``, in page-locked memory when ``x`` is
    a CuPy array.

    Copies between the GPU and page-locked memory run at the bus's speed,
    about twice what ordinary (pageable) memory allows; CuPy's pinned-memory
    pool hands the same blocks back call after call, so the (slow)
    page-locking happens once per size.
    """
    if is_cupy(x):
        return importlib.import_module("cupyx").empty_pinned(x.shape, x.dtype)
    return np.empty(x.shape, x.dtype)


def copy_to_host(x: Any, out: np.ndarray) -> np.ndarray:
    """Write ``x``'s values into the host array ``out`` (shaped like ``x``); return ``out``."""
    if is_cupy(x) and x.flags.c_contiguous:
        x.get(out=out, blocking=True)
    else:
        out[...] = to_host(x)
    return out


def copy_from_host(dst: Any, host: np.ndarray) -> None:
    """Write the host array ``host`` into ``dst`` (NumPy or CuPy, same shape) in place."""
    if is_cupy(dst):
        if dst.flags.c_contiguous and host.flags.c_contiguous:
            # From page-locked memory the copy is asynchronous: wait for it, as the
            # caller may reuse ``host`` at once (a staging buffer back in the pool).
            stream = _cupy().cuda.get_current_stream()  # type: ignore[union-attr]
            dst.set(host, stream=stream)
            stream.synchronize()
        else:
            dst[...] = _cupy().asarray(host)  # type: ignore[union-attr]
    else:
        dst[...] = host


def to_device(x: Any, device: int | None = None) -> Any:
    """A CuPy array on ``device`` (the current device when None) with the values of ``x``."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "to_device needs CuPy: pip install '.[gpu-cuda13]' (CUDA 13) or '.[gpu]' "
            "(CUDA 12) from the axondist checkout; nvidia-smi's 'CUDA Version' tells which"
        ) from exc
    x = as_array(x)
    if device is None:
        return cupy.asarray(x)
    with cupy.cuda.Device(device):
        return cupy.asarray(x)


def is_floating(dtype: Any) -> bool:
    """True for float16/32/64 and bfloat16."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"


def check_dtype(dtype: Any, where: str) -> np.dtype:
    """The dtype as ``np.dtype`` if axondist can communicate it, else a clear error."""
    if type(dtype) in _SUPPORTED_DTYPE_CLASSES and dtype.isnative:  # a supported np.dtype
        return dtype
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return bfloat16_dtype()  # its class joins the fast path's
    if dtype not in _NUMPY_DTYPES:
        names = ", ".join(SUPPORTED_DTYPE_NAMES)
        raise UnsupportedDTypeError(f"{where}: dtype {dtype} is not supported; use one of {names}")
    return dtype


def quiet_nan_compare(x: Any) -> contextlib.AbstractContextManager[Any]:
    """A context in which NumPy's minimum/maximum meet NaN without a RuntimeWarning (they
    propagate it, which is what the caller wants); a no-op for other libraries."""
    if isinstance(x, np.ndarray):
        return np.errstate(invalid="ignore")
    return contextlib.nullcontext()


def is_writable(x: Any) -> bool:
    """True when a collective may write into ``x`` in place (writable, C-contiguous)."""
    flags = x.flags
    return bool(flags.c_contiguous and (not isinstance(x, np.ndarray) or flags.writeable))


def check_writable(x: Any, where: str) -> None:
    """Refuse a buffer that a collective must write in place but cannot."""
    flags = x.flags  # one flags object: this runs on every in-place collective
    if isinstance(x, np.ndarray) and not flags.writeable:
        raise InvalidBufferError(
            f"{where}: the array is read-only; pass a writable array (e.g. x.copy())"
        )
    if not flags.c_contiguous:
        raise InvalidBufferError(
            f"{where}: the array of shape {tuple(x.shape)} is not C-contiguous, so it cannot "
            "be written in place; pass xp.ascontiguousarray(x) and use the returned array"
        )


def layout_of(x: Any) -> tuple[str, str]:
    """``(library, layout)`` of a NumPy or CuPy array: the :func:`library_name`, and
    ``"ok"`` when a collective may write it in place (writable, C-contiguous),
    ``"read-only"`` or ``"strided"`` when not (what a call's key records)."""
    if type(x) is np.ndarray:  # the common case, kept cheap
        flags = x.flags
        if flags.carray:
            return "numpy", "ok"
        return "numpy", "read-only" if not flags.writeable else "strided"
    library = library_name(x)
    if not x.flags.c_contiguous:
        return library, "strided"
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        return library, "read-only"
    return library, "ok"


def contiguous(x: Any) -> Any:
    """``x`` itself when C-contiguous, else a contiguous copy (for read-only inputs)."""
    if x.flags.c_contiguous:
        return x
    return namespace(x).ascontiguousarray(x)


def flat_view(x: Any) -> Any:
    """A 1-D view of a C-contiguous array (0-d arrays give one element)."""
    return x.reshape(-1)


@dataclass(frozen=True)
class FlatLayout:
    """Where each of several arrays lives inside one flat buffer.

    Attributes:
        shapes: the arrays' shapes, in buffer order.
        offsets: start element of each array in the buffer.
        dtype: the buffer's dtype.
    """

    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, shapes: Iterable[Sequence[int]], dtype: Any) -> FlatLayout:
        """The layout packing arrays of ``shapes`` back to back, in order, with no padding."""
        shapes_t = tuple(tuple(int(d) for d in s) for s in shapes)
        offsets, total = [], 0
        for shape in shapes_t:
            offsets.append(total)
            total += prod(shape)
        return cls(shapes_t, tuple(offsets), np.dtype(dtype))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Elements of each array, in buffer order."""
        return tuple(prod(s) for s in self.shapes)

    @property
    def numel(self) -> int:
        """Total number of elements in the buffer."""
        return sum(self.sizes)

    def views(self, buffer: Any) -> list[Any]:
        """The arrays as views into ``buffer`` (no copies)."""
        if buffer.size != self.numel:
            raise InvalidBufferError(
                f"FlatLayout.views: buffer has {buffer.size} elements, layout needs {self.numel}"
            )
        flat = buffer.reshape(-1)
        return [
            flat[off : off + n].reshape(shape)
            for off, n, shape in zip(self.offsets, self.sizes, self.shapes)
        ]

    def pack(self, arrays: Sequence[Any], out: Any = None) -> Any:
        """Copy ``arrays`` into ``out`` (allocated when None) and return it."""
        if len(arrays) != len(self.shapes):
            raise ValueError(f"FlatLayout.pack: got {len(arrays)} arrays, layout has "
                             f"{len(self.shapes)}")
        if out is None:
            out = namespace(*arrays).empty(self.numel, dtype=self.dtype)
        for view, a in zip(self.views(out), arrays):
            if tuple(a.shape) != view.shape:
                raise ValueError(f"FlatLayout.pack: array of shape {tuple(a.shape)} where the "
                                 f"layout has {view.shape}")
            view[...] = a
        return out


def flatten(arrays: Sequence[Any], dtype: Any = None) -> tuple[Any, FlatLayout]:
    """Copy ``arrays`` into one contiguous 1-D buffer; return it and its layout.

    Args:
        arrays: NumPy or CuPy arrays (not mixed).
        dtype: the buffer's dtype; the arrays' common result type when None.
    """
    arrays = [as_array(a) for a in arrays]
    xp = namespace(*arrays)
    if dtype is None:
        dtype = np.result_type(*arrays) if arrays else np.float32
    layout = FlatLayout.of((a.shape for a in arrays), dtype)
    return layout.pack(arrays, out=xp.empty(layout.numel, dtype=layout.dtype)), layout


def unflatten(buffer: Any, layout: FlatLayout) -> list[Any]:
    """Views of ``buffer`` with the shapes of ``layout`` (the inverse of :func:`flatten`)."""
    return layout.views(buffer)


def library_name(x: Any) -> str:
    """``"cupy"`` for CuPy arrays, ``"numpy"`` otherwise (travels in message headers)."""
    return "cupy" if is_cupy(x) else "numpy"


def module_named(lib: str) -> ModuleType:
    """The array module for a :func:`library_name` (imports CuPy only when asked for)."""
    if lib == "cupy":
        import cupy

        return cupy
    return np


#: ``str(dtype)`` by dtype, and back: NumPy builds the text, and parses it, on every call
#: (a few microseconds, more than a small message's transfer).
_NAMES: dict[np.dtype, str] = {}
_DTYPES: dict[str, np.dtype] = {}


def dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)`` (``"float32"``, ``"bfloat16"``), the name :func:`dtype_named` reads."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype)
    return name


def dtype_named(name: str) -> np.dtype:
    """``np.dtype`` for a dtype's ``str()``, bfloat16 included."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = bfloat16_dtype() if name == "bfloat16" else np.dtype(name)
        _DTYPES[name] = dtype
    return dtype


def describe(x: Any) -> str:
    """Short text for error messages: ``float32[3, 4] (numpy)``."""
    return f"{x.dtype}{list(x.shape)} ({library_name(x)})"
