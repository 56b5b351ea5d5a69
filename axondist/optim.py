"""Optimizers that update :class:`~axondist.Parameter` values in place.

The update formulas are those of ``torch.optim`` (SGD with momentum/Nesterov,
Adam with L2 weight decay added to the gradient, AdamW with decoupled weight
decay), written with the array namespace of each parameter so the same code
runs on NumPy and CuPy arrays.

Precision: parameters in float32/float64 are updated in their own dtype, with
state arrays of that dtype. float16 and bfloat16 parameters keep float32
state; each step upcasts the parameter and gradient to float32, computes the
update in float32 and writes the result back rounded to the parameter's dtype.
(No float32 master copy of the weights is kept: updates smaller than half a
unit in the last place of a float16 weight are lost, as with torch.)

``.data`` is written in place (``p.data[...] = ...``), never replaced, so
views of a parameter (e.g. a flat buffer an FSDP shard lives in) stay valid.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from . import _array
from ._validate import check_real_gradient, real_number
from .parameter import Parameter, parameters_of

#: state_dict format version, bumped when the layout below changes.
STATE_DICT_VERSION = 1

#: Elements per block of Adam's update of a large NumPy parameter: the few arrays one block
#: touches stay in a core's cache between its passes.
BLOCK = 65536


def _compute_dtype(dtype: Any) -> np.dtype:
    """The dtype updates of a parameter of ``dtype`` are computed (and state kept) in."""
    dtype = np.dtype(dtype)
    if dtype in (np.float32, np.float64):
        return dtype
    if dtype.name in _array.HALF_PRECISION:
        return np.dtype(np.float32)
    raise TypeError(
        f"optimizer: parameter dtype {dtype} cannot be trained; parameters must be "
        "float16, bfloat16, float32 or float64"
    )


_MEANINGS = {"lr": "the learning rate", "momentum": "the momentum factor",
             "weight_decay": "the weight decay factor", "dampening": "the momentum dampening",
             "eps": "the term added to Adam's denominator"}


def _check_nonneg(name: str, value: Any, where: str) -> float:
    """A hyper-parameter as a finite float >= 0 (a string such as '0.1', inf or NaN refused)."""
    return real_number(value, where, name, meaning=_MEANINGS.get(name, ""))


def _check_flag(name: str, value: Any, where: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name}={value!r} must be True or False, got "
                        f"{type(value).__name__}")
    return bool(value)


class Optimizer:
    """Base class: holds the parameters, per-parameter state and the step count.

    Subclasses define :meth:`_update` for one parameter (in its compute dtype)
    and the names of their hyper-parameters and state arrays.

    Args:
        params: a model (anything :func:`~axondist.parameters_of` accepts) or an
            iterable of Parameters. The order fixes the state_dict keys.
        lr: the learning rate (settable later through ``opt.lr = ...``).

    Attributes:
        params: the Parameters, in order.
        state: per parameter index, a dict of state arrays (and ``"step"``, the
            number of updates that parameter received). Absent until the
            parameter's first update.
        step_count: how many times :meth:`step` ran.
    """

    #: names of the hyper-parameters saved in state_dict (besides ``lr``).
    _hyper_names: tuple[str, ...] = ()
    #: names of the per-parameter state arrays.
    _state_names: tuple[str, ...] = ()

    def __init__(self, params: Any, lr: float) -> None:
        self.params: list[Parameter] = optimizer_params(params, type(self).__name__)
        if not self.params:
            raise ValueError(f"{type(self).__name__}: got an empty parameter list")
        for p in self.params:
            _compute_dtype(p.dtype)
        self.lr = lr
        self.state: dict[int, dict[str, Any]] = {}
        self.step_count = 0

    @property
    def lr(self) -> float:
        """The learning rate used by the next :meth:`step`."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        """Set the learning rate; raises TypeError for a non-number (``'0.1'``) and
        ValueError for a negative, infinite or NaN value."""
        self._lr = _check_nonneg("lr", value, type(self).__name__)

    # --- stepping ------------------------------------------------------------------

    def step(self) -> None:
        """Update every parameter whose ``.grad`` is set; skip those with ``grad=None``.

        A ``.grad`` that holds a torch tensor or JAX array is read through
        ``axondist.as_array`` (a view, no copy), as the wrappers read it.

        Raises:
            ValueError: a gradient's shape differs from its parameter's.
            UnsupportedDTypeError: a gradient is complex (never cast to real), or its
                framework's dtype has no NumPy/CuPy counterpart.
        """
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = _array.as_array(p.grad)
            check_real_gradient(grad, f"{type(self).__name__}.step", i, p.name)
            if tuple(grad.shape) != p.shape:
                raise ValueError(
                    f"{type(self).__name__}.step: parameter {i} ({p.name or 'unnamed'}) has shape "
                    f"{p.shape} but its .grad has shape {tuple(grad.shape)}"
                )
            xp = _array.namespace(p.data, grad)
            cdt = _compute_dtype(p.dtype)
            state = self.state.get(i)
            if state is None:
                state = self.state[i] = {"step": 0}
            state["step"] += 1
            if p.data.dtype == cdt:
                work = p.data
                g = grad if grad.dtype == cdt else grad.astype(cdt)
                self._update(xp, work, g, state)
            else:
                work = p.data.astype(cdt)
                self._update(xp, work, grad.astype(cdt), state)
                p.data[...] = work.astype(p.data.dtype)
        self.step_count += 1

    def _update(self, xp: Any, p: Any, g: Any, state: dict[str, Any]) -> None:
        """Update ``p`` in place from gradient ``g`` (both in the compute dtype).

        ``g`` may be the user's ``.grad`` array: never write into it.
        """
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients.

        Args:
            set_to_none: ``grad = None`` (the default). With False the gradient
                arrays are zeroed in place, keeping their memory: use that when
                ``.grad`` is a view into a DDP bucket that must stay shared.
        """
        for p in self.params:
            p.zero_grad(set_to_none)

    # --- state ---------------------------------------------------------------------

    def hyperparameters(self) -> dict[str, Any]:
        """The hyper-parameters as a plain dict (``lr`` and the subclass's)."""
        out: dict[str, Any] = {"lr": self.lr}
        for name in self._hyper_names:
            out[name] = getattr(self, name)
        return out

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the optimizer as a plain dict (arrays are copies).

        Layout::

            {"optimizer": "Adam",                # the class name
             "version": 1,
             "hyperparameters": {"lr": ..., "betas": (..., ...), ...},
             "step_count": 12,                  # calls to step()
             "state": {0: {"step": 12,          # updates of parameter 0
                           "exp_avg": array, "exp_avg_sq": array},
                       ...}}                    # keyed by parameter index

        Parameters that never received a gradient have no ``state`` entry.
        State arrays have the parameter's shape and the compute dtype (float32
        for float16/bfloat16 parameters) and live where the parameter lives.
        """
        state = {
            i: {k: (v.copy() if k != "step" else int(v)) for k, v in s.items()}
            for i, s in self.state.items()
        }
        return {
            "optimizer": type(self).__name__,
            "version": STATE_DICT_VERSION,
            "hyperparameters": self.hyperparameters(),
            "step_count": self.step_count,
            "state": state,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyper-parameters, step count and state from :meth:`state_dict`.

        State arrays are copied into fresh arrays of the parameter's namespace
        and compute dtype, so a NumPy snapshot loads into a CuPy optimizer.

        Raises:
            ValueError: the snapshot is of another optimizer class, names a
                parameter index this optimizer does not have, lacks or adds a
                state array, or has an array whose shape differs from its
                parameter's.
        """
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, dict) or "state" not in state_dict:
            raise ValueError(f"{where}: expected a dict made by state_dict(), got "
                             f"{type(state_dict).__name__}")
        kind = state_dict.get("optimizer")
        if kind != type(self).__name__:
            raise ValueError(f"{where}: the snapshot is of optimizer {kind!r}, not "
                             f"{type(self).__name__!r}; load it into a {kind} instead")
        new_state: dict[int, dict[str, Any]] = {}
        for key, entry in state_dict["state"].items():
            i = int(key)
            if not 0 <= i < len(self.params):
                raise ValueError(f"{where}: state for parameter index {i}, but the optimizer has "
                                 f"{len(self.params)} parameters (0..{len(self.params) - 1})")
            p = self.params[i]
            names = set(entry) - {"step"}
            expected = self._state_names_for(entry)
            if names != expected:
                raise ValueError(f"{where}: parameter {i} state has arrays {sorted(names)}, "
                                 f"expected {sorted(expected)}")
            xp = _array.namespace(p.data)
            cdt = _compute_dtype(p.dtype)
            restored: dict[str, Any] = {"step": int(entry.get("step", 0))}
            for name in names:
                arr = entry[name]
                if tuple(arr.shape) != p.shape:
                    raise ValueError(
                        f"{where}: state {name!r} of parameter {i} ({p.name or 'unnamed'}) has "
                        f"shape {tuple(arr.shape)}, the parameter has shape {p.shape}"
                    )
                restored[name] = xp.array(xp.asarray(arr), dtype=cdt, copy=True)
            new_state[i] = restored
        hyper = dict(state_dict.get("hyperparameters", {}))
        self.lr = hyper.pop("lr", self.lr)
        for name, value in hyper.items():
            if name not in self._hyper_names:
                raise ValueError(f"{where}: unknown hyper-parameter {name!r}; "
                                 f"{type(self).__name__} has lr, {', '.join(self._hyper_names)}")
            setattr(self, name, tuple(value) if isinstance(value, list) else value)
        self._validate()
        self.state = new_state
        self.step_count = int(state_dict.get("step_count", 0))

    def _state_names_for(self, entry: dict[str, Any]) -> set[str]:
        return set(self._state_names)

    def state_names(self) -> tuple[str, ...]:
        """Names of the state arrays each updated parameter gets (sorted; may be empty).

        Each has the parameter's shape and :meth:`state_dtype`, so a parameter
        of ``n`` elements costs ``n * len(state_names()) * state_dtype(p).itemsize``
        bytes of state once it has been updated.
        """
        return tuple(sorted(self._state_names_for({})))

    @staticmethod
    def state_dtype(param_dtype: Any) -> np.dtype:
        """The dtype of the state (and of the update arithmetic) for a parameter dtype.

        float32/float64 keep their own; float16 and bfloat16 use float32.

        Raises:
            TypeError: ``param_dtype`` cannot be trained (not floating point).
        """
        return _compute_dtype(param_dtype)

    def _validate(self) -> None:
        """Check the hyper-parameters (subclasses raise ValueError on bad values)."""

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({len(self.params)} parameters, {hp})"


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, as ``torch.optim.SGD``.

    With ``d = g + weight_decay * p``::

        b = d                               (first step)
        b = momentum * b + (1 - dampening) * d   (later steps)
        d = d + momentum * b   if nesterov else   b
        p = p - lr * d

    (the momentum lines only when ``momentum > 0``).

    Raises:
        ValueError: negative hyper-parameters, or Nesterov without momentum or
            with dampening.
    """

    _hyper_names = ("momentum", "weight_decay", "nesterov", "dampening")

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, dampening: float = 0.0) -> None:
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.nesterov = nesterov
        self.dampening = dampening
        self._validate()
        super().__init__(params, lr)

    def _validate(self) -> None:
        self.momentum = _check_nonneg("momentum", self.momentum, "SGD")
        self.weight_decay = _check_nonneg("weight_decay", self.weight_decay, "SGD")
        self.dampening = _check_nonneg("dampening", self.dampening, "SGD")
        self.nesterov = _check_flag("nesterov", self.nesterov, "SGD")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD: nesterov=True needs momentum > 0 and dampening = 0")

    def _state_names_for(self, entry: dict[str, Any]) -> set[str]:
        return {"momentum_buffer"} if self.momentum > 0 else set()

    def _update(self, xp: Any, p: Any, g: Any, state: dict[str, Any]) -> None:
        if self.weight_decay:
            g = g + self.weight_decay * p  # a new array: the user's grad is left alone
        if self.momentum > 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                # xp.array, not g.copy(): arithmetic on 0-d arrays gives NumPy scalars
                buf = state["momentum_buffer"] = xp.array(g, dtype=p.dtype, copy=True)
            else:
                xp.multiply(buf, self.momentum, out=buf)
                buf += (1.0 - self.dampening) * g
            g = g + self.momentum * buf if self.nesterov else buf
        p -= self.lr * g


class Adam(Optimizer):
    """Adam, as ``torch.optim.Adam`` (weight decay is L2: added to the gradient).

    With ``g = g + weight_decay * p`` and ``t`` the parameter's step count::

        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

    Raises:
        ValueError: a beta outside [0, 1), or negative lr/eps/weight_decay.
    """

    _hyper_names = ("betas", "eps", "weight_decay")
    _state_names = ("exp_avg", "exp_avg_sq")
    _decoupled = False

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__"):
            raise TypeError(f"{type(self).__name__}: betas must be two numbers in [0, 1), such "
                            f"as (0.9, 0.999), got {type(betas).__name__} {betas!r}")
        self.betas = tuple(betas)
        self.eps = eps
        self.weight_decay = weight_decay
        self._validate()
        super().__init__(params, lr)

    def _validate(self) -> None:
        name = type(self).__name__
        numbers_ = [isinstance(b, numbers.Real) and not isinstance(b, (bool, np.bool_))
                    for b in self.betas]
        if len(self.betas) != 2 or not all(numbers_) or not all(
                0.0 <= float(b) < 1.0 for b in self.betas):  # NaN fails too
            kind = TypeError if not all(numbers_) else ValueError
            raise kind(f"{name}: betas must be two numbers in [0, 1) (the decays of the moving "
                       f"averages), such as (0.9, 0.999); got {self.betas!r}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        self.eps = _check_nonneg("eps", self.eps, name)
        self.weight_decay = _check_nonneg("weight_decay", self.weight_decay, name)

    def _update(self, xp: Any, p: Any, g: Any, state: dict[str, Any]) -> None:
        m = state.get("exp_avg")
        if m is None:
            m = state["exp_avg"] = xp.zeros_like(p)
            state["exp_avg_sq"] = xp.zeros_like(p)
        v = state["exp_avg_sq"]
        t = state["step"]
        scalars = (self.lr / (1.0 - self.betas[0] ** t), math.sqrt(1.0 - self.betas[1] ** t))
        parts = 2 if self.weight_decay and not self._decoupled else 1  # + the decayed gradient
        if xp is np and p.size > BLOCK and all(a.flags.c_contiguous for a in (p, g, m, v)):
            # Block by block, so the passes below read and write cache, not memory: the
            # arithmetic of each element is the same, only the order of elements changes.
            pf, gf, mf, vf = (a.reshape(-1) for a in (p, g, m, v))
            scratch = self._scratch(xp, p.dtype, parts * BLOCK)
            for lo in range(0, p.size, BLOCK):
                hi = min(lo + BLOCK, p.size)
                self._adam_block(xp, pf[lo:hi], gf[lo:hi], mf[lo:hi], vf[lo:hi],
                                 scratch[:hi - lo], scratch[(parts - 1) * BLOCK:][:hi - lo],
                                 scalars)
        else:
            scratch = self._scratch(xp, p.dtype, parts * p.size)
            self._adam_block(xp, p, g, m, v, scratch[:p.size].reshape(p.shape),
                             scratch[(parts - 1) * p.size:][:p.size].reshape(p.shape), scalars)

    def _adam_block(self, xp: Any, p: Any, g: Any, m: Any, v: Any, s: Any, decayed: Any,
                    scalars: tuple[float, float]) -> None:
        """The update of one block in place: every temporary lands in ``s`` (and the L2-decayed
        gradient in ``decayed``), as fresh temporaries would cost page faults on every step."""
        b1, b2 = self.betas
        step_size, bias2_root = scalars
        if self.weight_decay:
            if self._decoupled:
                p *= 1.0 - self.lr * self.weight_decay
            else:
                xp.multiply(p, self.weight_decay, out=decayed)
                decayed += g  # g + weight_decay * p, never written into the user's grad
                g = decayed
        xp.multiply(m, b1, out=m)
        xp.multiply(g, 1.0 - b1, out=s)
        m += s
        xp.multiply(v, b2, out=v)
        xp.multiply(g, g, out=s)
        s *= 1.0 - b2
        v += s
        xp.sqrt(v, out=s)
        s /= bias2_root
        s += self.eps
        xp.divide(m, s, out=s)
        s *= step_size
        p -= s

    def _scratch(self, xp: Any, dtype: Any, size: int) -> Any:
        """A 1-D scratch array of at least ``size`` elements: one buffer per dtype and array
        library, grown when needed and reused by every later step."""
        key = (xp.__name__, dtype)
        scratches: dict[Any, Any] = self.__dict__.setdefault("_scratch_buffers", {})
        flat = scratches.get(key)
        if flat is None or flat.size < size:
            flat = scratches[key] = xp.empty(size, dtype=dtype)
        return flat


class AdamW(Adam):
    """AdamW, as ``torch.optim.AdamW``: Adam with decoupled weight decay.

    Each step first shrinks the weights, ``p = p * (1 - lr * weight_decay)``,
    then applies the Adam update of the plain gradient (no L2 term).
    """

    _decoupled = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)


def optimizer_params(params: Any, where: str = "optimizer") -> list[Parameter]:
    """The Parameters for ``params``: a model, list/dict of Parameters, or any iterable.

    Raises:
        TypeError: ``params`` is None, a string, or not iterable (naming ``where``).
    """
    if params is None or isinstance(params, (str, bytes)) or not (
            isinstance(params, (Parameter, dict)) or hasattr(params, "parameters")
            or hasattr(params, "__iter__")):
        raise TypeError(f"{where}: params must be a model, a Parameter or a list of Parameters "
                        f"(e.g. {where}(model.parameters(), lr=0.1)), got "
                        f"{type(params).__name__} {params!r}")
    if not isinstance(params, (list, tuple, dict, Parameter)) and not hasattr(params, "parameters"):
        # generators and dict views become a list once, so they are not consumed twice
        params = list(params)
    return parameters_of(params)


__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "optimizer_params"]
