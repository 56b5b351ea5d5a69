"""Host memory another process of this host can map: buffers a two-rank plan reads and
writes on both sides, with no MPI transfer in between.

A region is an anonymous memory file (``memfd_create``) mapped into this process. Its
locator (pid, file descriptor, inode, bytes) lets a process of the same user on the same
host map it too, through ``/proc/<pid>/fd/<fd>``: the kernel allows that where it allows
MPICH's single-copy reads (:func:`~axondist.backends.mpi.single_copy.why_not_permitted`).
Nothing is named in ``/dev/shm``, so a crash leaves nothing behind: the memory goes with
the last mapping. A region lives while any array of it does; its file descriptor is closed
then too, and :func:`locate` no longer finds it.
"""

from __future__ import annotations

import mmap
import os
import weakref
from typing import Any, NamedTuple

import numpy as np


class Locator(NamedTuple):
    """Where another process finds a region: its owner's pid and file descriptor, the
    file's inode (a descriptor number closed and reused names another file) and size."""

    pid: int
    fd: int
    inode: int
    nbytes: int


#: Every live region: its first byte's address -> (its byte array, weakly; its locator).
_REGIONS: dict[int, tuple[weakref.ref[np.ndarray], Locator]] = {}


def _forget(address: int, fd: int) -> None:
    _REGIONS.pop(address, None)
    os.close(fd)


def allocate(nbytes: int, dtype: Any) -> np.ndarray:
    """A zeroed 1-D array of ``nbytes // itemsize`` elements of ``dtype`` in a new region
    (its pages touched once here, so no later call pays their first faults)."""
    size = max(int(nbytes), 1)
    fd = os.memfd_create("axondist-region", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size)
        inode = os.fstat(fd).st_ino
    except BaseException:
        os.close(fd)
        raise
    whole = np.frombuffer(memory, np.uint8)
    whole[...] = 0
    address = whole.ctypes.data
    _REGIONS[address] = (weakref.ref(whole), Locator(os.getpid(), fd, inode, size))
    weakref.finalize(whole, _forget, address, fd)
    return whole[:int(nbytes) - int(nbytes) % np.dtype(dtype).itemsize].view(dtype)


def locate(array: np.ndarray) -> tuple[Locator, int] | None:
    """The region ``array``'s memory lies in and the byte offset where it starts, or None
    (an array of ordinary memory, or one that is not contiguous)."""
    if not _REGIONS or not array.flags.c_contiguous:
        return None
    address = array.ctypes.data
    for start, (whole, locator) in _REGIONS.items():
        if start <= address and address + array.nbytes <= start + locator.nbytes \
                and whole() is not None:
            return locator, address - start
    return None


def region_array(locator: Locator) -> np.ndarray | None:
    """The bytes of this process's live region ``locator``, or None when it is gone."""
    for whole, known in _REGIONS.values():
        if known == locator:
            return whole()
    return None


def map_region(locator: Locator) -> np.ndarray:
    """Another process's region (or this one's), mapped here, as bytes.

    Raises:
        PermissionError: the kernel refuses (another user's process, or a ptrace policy).
        RuntimeError: the process no longer holds that region (it ended or freed it).
    """
    path = f"/proc/{locator.pid}/fd/{locator.fd}"
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise RuntimeError(f"shared region {locator} is gone: process {locator.pid} ended "
                           "or freed it") from None
    try:
        if os.fstat(fd).st_ino != locator.inode:
            raise RuntimeError(f"shared region {locator} is gone: process {locator.pid} "
                               "freed it and reused its file descriptor")
        return np.frombuffer(mmap.mmap(fd, locator.nbytes), np.uint8)
    finally:
        os.close(fd)
