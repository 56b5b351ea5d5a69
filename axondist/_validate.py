"""Argument checks shared by every public entry point.

One wording for every error of a kind: a rank outside its group, a member
list that is not a list of ranks, a name that is not one of an enum's
members. Each error names the function, the argument, what came and what to
pass instead.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .errors import RankError, UnsupportedDTypeError

E = TypeVar("E", bound=enum.Enum)


def as_rank(value: Any, size: int, what: str, arg: str) -> int:
    """``value`` as a plain int rank of a group of ``size`` ranks.

    Accepts Python and NumPy integers (``np.int64(1)``); refuses bools,
    floats and anything outside ``0 .. size - 1``.

    Raises:
        RankError: not an integer, or outside the group.
    """
    if value.__class__ is int and 0 <= value < size:  # the common case, first
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RankError(f"{what}: {arg}={value!r} is not a rank (an int in 0..{size - 1}); "
                        f"got {type(value).__name__}")
    rank = int(value)
    if not 0 <= rank < size:
        raise RankError(f"{what}: {arg}={rank} is outside the group of {size} ranks "
                        f"(valid: 0..{size - 1}, ranks within the group)")
    return rank


def as_members(ranks: Any, size: int, what: str) -> list[int]:
    """``ranks`` as a list of distinct ranks of a group of ``size`` ranks.

    Raises:
        RankError: not a sequence of integers, empty, repeated or out of range.
    """
    if ranks is None or isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise RankError(f"{what}: ranks must be a list of ranks (ints in 0..{size - 1}), "
                        f"got {ranks!r}")
    members = [as_rank(r, size, what, "ranks[]") for r in ranks]
    if not members:
        raise RankError(f"{what}: ranks must not be empty; list at least one rank")
    if len(set(members)) != len(members):
        raise RankError(f"{what}: ranks {members} contain duplicates; list each rank once")
    return members


def parse_choice(cls: type[E], value: Any, what: str,
                 aliases: Mapping[str, E] | None = None) -> E:
    """A member of ``cls`` from itself, its name or its value, case-insensitively.

    Raises:
        ValueError: ``value`` names no member; the message lists the valid names.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        if aliases and key in aliases:
            return aliases[key]
        for member in cls:
            if key in (member.name.lower(), str(member.value).lower()):
                return member
    valid = ", ".join(repr(str(m.value)) for m in cls)
    raise ValueError(f"{what}={value!r} is not one of {cls.__name__}'s names; use one of {valid}")


def positive_seconds(value: Any, what: str, arg: str = "timeout") -> float:
    """``value`` as a finite number of seconds > 0.

    Raises:
        ValueError: not a number, NaN, infinite or not positive.
    """
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: {arg}={value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what}: {arg}={value!r} must be a finite number of seconds > 0 "
                         "(to wait longer, pass a large finite value)")
    return seconds


def positive_number(value: Any, what: str, arg: str) -> float:
    """``value`` as a finite float > 0 (sizes in MiB, factors).

    Raises:
        TypeError: not a real number (a string, None).
        ValueError: NaN, infinite or not positive.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: {arg} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{what}: {arg}={value!r} must be a finite number > 0")
    return number


def sequence_of(value: Any, what: str, arg: str) -> Sequence[Any]:
    """``value`` as a list, or a TypeError naming the argument when it is not iterable."""
    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{what}: {arg} must be a list, got {type(value).__name__} {value!r}")
    return list(value)


def check_real_gradient(grad: Any, where: str, index: int, name: str | None = None) -> None:
    """Refuse a complex gradient: averaging it into a real bucket would drop the imaginary part.

    Raises:
        UnsupportedDTypeError: ``grad``'s dtype is complex.
    """
    if np.dtype(grad.dtype).kind == "c":
        label = f"parameter {index}" + (f" ({name})" if name else "")
        raise UnsupportedDTypeError(
            f"{where}: the gradient of {label} is {grad.dtype}; complex gradients are not "
            "supported (casting to real would silently drop the imaginary part). Train the "
            "real and imaginary parts as two real Parameters, or pass grad.real if that is "
            "what you mean")


def check_tag(tag: Any, what: str) -> int:
    """``tag`` as a plain int message tag >= 0, refused the same way on every backend.

    MPI reserves negative tags (``MPI_ANY_TAG`` is one), so a tag that works on
    the mock world must also work under mpiexec.

    Raises:
        TypeError: not an integer (a bool, a float, a string).
        ValueError: negative.
    """
    if tag.__class__ is int and tag >= 0:  # the common case, first
        return tag
    if isinstance(tag, bool) or not isinstance(tag, numbers.Integral):
        raise TypeError(f"{what}: tag={tag!r} is not a message tag; pass an int >= 0 "
                        f"(got {type(tag).__name__})")
    if tag < 0:
        raise ValueError(f"{what}: tag={int(tag)} is negative; pass an int >= 0 (MPI reserves "
                         "negative tags, so every backend refuses them)")
    return int(tag)


def check_numeric_dtype(dtype: Any, what: str, arg: str) -> None:
    """Refuse a dtype that is not a number (object, string, bytes, datetime, structured).

    Booleans, integers, floats (bfloat16 included) and complex pass.

    Raises:
        UnsupportedDTypeError: naming ``arg``, the dtype and what to pass.
    """
    dt = np.dtype(dtype)
    if dt.kind in "biufc" or dt.name == "bfloat16":
        return
    kind = {"O": "Python objects", "U": "text", "S": "bytes", "M": "dates",
            "m": "time spans"}.get(dt.kind, "records")
    raise UnsupportedDTypeError(
        f"{what}: {arg} has dtype {dt} ({kind}), not numbers; pass a NumPy or CuPy array of "
        "numbers, e.g. np.asarray(values, dtype=np.float32)")


def positive_int(value: Any, what: str, arg: str) -> int:
    """``value`` as a plain int >= 1 (a size, a count); ``2.5`` is refused, never truncated.

    Raises:
        TypeError: not an integer (a float, a string, a bool).
        ValueError: below 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what}: {arg}={value!r} must be a positive int (>= 1), got "
                        f"{type(value).__name__}" + _int_hint(value, arg))
    if value < 1:
        raise ValueError(f"{what}: {arg}={int(value)} must be positive (an int >= 1)")
    return int(value)


def _int_hint(value: Any, arg: str) -> str:
    if not isinstance(value, float) or not math.isfinite(value):
        return ""
    if value.is_integer():
        return f"; pass {arg}={int(value)}"
    return f"; pass {arg}={math.floor(value)} or {math.ceil(value)} (it is never truncated)"


def real_number(value: Any, what: str, arg: str, *, low: float = 0.0,
                below: float | None = None, meaning: str = "") -> float:
    """``value`` as a finite float >= ``low`` (and < ``below`` when given): hyper-parameters.

    Raises:
        TypeError: not a real number (a string such as ``'0.1'``, None, a bool).
        ValueError: NaN, infinite or out of range.
    """
    about = f" ({meaning})" if meaning else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: {arg}{about} must be a number, got {type(value).__name__} "
                        f"{value!r}" + (f"; pass {arg}={value.strip()}" if isinstance(
                            value, str) and _is_float_text(value) else ""))
    number = float(value)
    span = f">= {low:g}" + (f" and < {below:g}" if below is not None else "")
    if not math.isfinite(number) or number < low or (below is not None and number >= below):
        raise ValueError(f"{what}: {arg}={value!r}{about} must be a finite number {span}")
    return number


def _is_float_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


MIB = 1 << 20


def check_state_names(state: Any, names: Sequence[str], where: str) -> None:
    """Raise unless ``state`` is a mapping holding exactly the parameter ``names``.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: a name missing or unknown (the first five of each are named).
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: state must be a dict {{name: array}} such as "
                        f"state_dict() returns, got {type(state).__name__}")
    missing = [n for n in names if n not in state]
    unknown = [k for k in state if k not in names]
    if missing or unknown:
        raise ValueError(f"{where}: the state's names differ from the model's: missing "
                         f"{missing[:5]}, unexpected {unknown[:5]}; load a state_dict() of "
                         "the same model")


def mib(nbytes: float) -> str:
    """``nbytes`` in MiB, as text ("12.5 MiB")."""
    return f"{nbytes / MIB:.3g} MiB"


__all__ = ["MIB", "as_members", "as_rank", "check_numeric_dtype", "check_real_gradient",
           "check_tag", "mib", "parse_choice", "positive_int", "positive_number",
           "positive_seconds", "real_number", "sequence_of"]
