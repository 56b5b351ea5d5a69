"""Bad arguments are refused with an error naming the argument, what came and what to pass:
Parameter data that is not numbers, optimizer hyper-parameters that are not finite numbers,
sizes that are not ints, FSDP over integer parameters, negative message tags."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist._validate import check_tag, positive_int, real_number
from axondist.errors import UnsupportedDTypeError
from axondist.optim import SGD, Adam, AdamW
from axondist.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP


@pytest.mark.parametrize(("data", "said"), [
    (None, "data=None is not an array"),
    ("str", r"data='str' has dtype <U3 \(text\), not numbers"),
    (b"raw", r"data=b'raw' has dtype \|S3 \(bytes\)"),
    (np.array([object(), 1.0], dtype=object), r"data \(ndarray\) has dtype object \(Python "
                                              r"objects\)"),
    (np.array(["2026-01-01"], dtype="datetime64[D]"),
     r"data \(ndarray\) has dtype datetime64\[D\] \(dates\)"),
])
def test_parameter_refuses_what_is_not_numbers(data, said) -> None:
    with pytest.raises(UnsupportedDTypeError, match=rf"Parameter\('w'\): {said}.*pass a "):
        ad.Parameter(data, "w")


@pytest.mark.parametrize("data", [np.zeros(2, bool), np.arange(3), 1.5, [1, 2],
                                  np.zeros(2, np.complex64), np.zeros(2, np.float16)])
def test_parameter_takes_arrays_of_numbers(data) -> None:
    assert ad.Parameter(data).size == np.size(data)


HYPER = {SGD: ("lr", "momentum", "weight_decay", "dampening"),
         Adam: ("lr", "eps", "weight_decay", "betas[0]", "betas[1]"),
         AdamW: ("lr", "eps", "weight_decay", "betas[0]", "betas[1]")}
NOT_NUMBERS = st.sampled_from(["0.1", None, True, [0.1], b"1", object()])
NOT_FINITE_OR_NEGATIVE = st.one_of(st.sampled_from([math.inf, -math.inf, math.nan]),
                                   st.floats(max_value=-1e-300, allow_nan=False))


def _build(cls, name: str, value):
    params = [ad.Parameter(np.ones(3))]
    if name.startswith("betas"):
        betas = [0.9, 0.999]
        betas[int(name[-2])] = value
        return cls(params, betas=tuple(betas))
    return cls(params, **({"lr": 0.1} if cls is SGD and name != "lr" else {}), **{name: value})


@settings(max_examples=60, deadline=None)
@given(cls=st.sampled_from(sorted(HYPER, key=lambda c: c.__name__)), data=st.data(),
       value=st.one_of(NOT_NUMBERS, NOT_FINITE_OR_NEGATIVE))
def test_every_optimizer_refuses_a_hyperparameter_that_is_not_a_finite_number(cls, data,
                                                                              value) -> None:
    name = data.draw(st.sampled_from(HYPER[cls]))
    kind = ValueError if isinstance(value, float) else TypeError
    said = (r"betas must be two numbers in \[0, 1\)" if name.startswith("betas") else
            rf"{name}.*(must be a number|must be a finite number)")
    with pytest.raises(kind, match=rf"^{cls.__name__}: {said}"):
        _build(cls, name, value)


@settings(max_examples=40, deadline=None)
@given(cls=st.sampled_from(sorted(HYPER, key=lambda c: c.__name__)), data=st.data(),
       value=st.floats(0.0, 0.99, allow_nan=False))
def test_every_optimizer_takes_finite_hyperparameters(cls, data, value) -> None:
    name = data.draw(st.sampled_from(HYPER[cls]))
    opt = _build(cls, name, value)
    opt.params[0].grad = np.ones(3)
    opt.step()
    assert np.isfinite(opt.params[0].data).all()


def test_the_reported_cases() -> None:
    params = [ad.Parameter(np.ones(3))]
    with pytest.raises(ValueError, match=r"AdamW: lr=inf \(the learning rate\) must be a finite "
                                         "number >= 0"):
        AdamW(params, lr=math.inf)
    with pytest.raises(TypeError, match=r"SGD: lr \(the learning rate\) must be a number, got "
                                        r"str '0.1'; pass lr=0.1"):
        SGD(params, lr="0.1")
    opt = SGD(params, lr=0.1)
    with pytest.raises(ValueError, match="lr=nan"):
        opt.lr = math.nan
    assert opt.lr == 0.1  # a refused value leaves the old one
    with pytest.raises(TypeError, match="SGD: nesterov='yes' must be True or False"):
        SGD(params, lr=0.1, momentum=0.9, nesterov="yes")
    with pytest.raises(TypeError, match=r"Adam: betas must be two numbers in \[0, 1\), such as"):
        Adam(params, betas="0.9")


@given(st.one_of(st.floats(allow_nan=True), st.text(max_size=3), st.integers(max_value=0),
                 st.booleans(), st.none()))
def test_positive_int_refuses_everything_but_ints_from_1(value) -> None:
    with pytest.raises((TypeError, ValueError),
                       match=r"^f: n=.* must be (a positive int \(>= 1\)|positive \(an int >= 1)"):
        positive_int(value, "f", "n")


@given(st.integers(1, 2**62))
def test_positive_int_takes_ints_from_1(value) -> None:
    assert positive_int(value, "f", "n") == value
    assert positive_int(np.int64(value), "f", "n") == value


def test_tensor_parallel_sizes_are_never_truncated() -> None:
    w = ad.World.mock()
    with pytest.raises(TypeError, match=r"TensorParallelMLP: hidden_features=2.5 must be a "
                                        r"positive int \(>= 1\), got float; pass "
                                        r"hidden_features=2 or 3 \(it is never truncated\)"):
        TensorParallelMLP(4, 2.5, 3, group=w)
    with pytest.raises(TypeError, match="ColumnParallelLinear: out_features='8' must be a pos"):
        ColumnParallelLinear(4, "8", group=w)
    with pytest.raises(ValueError, match=r"RowParallelLinear: in_features=0 must be positive"):
        RowParallelLinear(0, 3, group=w)
    assert TensorParallelMLP(4, np.int64(6), 3, group=w).fc1.out_features == 6


def test_fsdp_refuses_an_integer_parameter() -> None:
    params = [ad.Parameter(np.ones(4, np.float32), "w"), ad.Parameter(np.arange(3), "ids")]
    with pytest.raises(UnsupportedDTypeError, match=r"FullyShardedDataParallel: parameter 1 "
                                                    r"\(ids\) is int64; FSDP shards, averages and "
                                                    r"updates floating-point parameters only"):
        ad.FSDP(params, ad.World.mock())


@given(st.integers(0, 2**40))
def test_check_tag_takes_ints_from_0(tag) -> None:
    assert check_tag(tag, "send") == tag
    assert check_tag(np.int32(min(tag, 2**31 - 1)), "send") == min(tag, 2**31 - 1)


@given(st.integers(max_value=-1))
def test_check_tag_refuses_a_negative_tag(tag) -> None:
    with pytest.raises(ValueError, match=rf"^send: tag={tag} is negative; pass an int >= 0 "
                                         r"\(MPI reserves negative tags"):
        check_tag(tag, "send")


@pytest.mark.parametrize("tag", [1.0, "1", None, True])
def test_check_tag_refuses_what_is_not_an_int(tag) -> None:
    with pytest.raises(TypeError, match=r"^recv: tag=.* is not a message tag; pass an int >= 0"):
        check_tag(tag, "recv")


def test_real_number_names_what_the_value_means() -> None:
    with pytest.raises(ValueError, match=r"^f: x=-1 \(a size\) must be a finite number >= 0$"):
        real_number(-1, "f", "x", meaning="a size")
    with pytest.raises(ValueError, match=r"must be a finite number >= 0 and < 1$"):
        real_number(1.0, "f", "x", below=1.0)


@pytest.mark.parametrize("tag", [-1, 1.5, "0", True])
def test_send_and_recv_refuse_a_bad_tag_on_the_mock_world_as_on_mpi(tag) -> None:
    def body(world: ad.World) -> list[str]:
        errors = []
        for call in (lambda: ad.send(np.ones(2), dst=1 - world.rank, tag=tag),
                     lambda: ad.recv(src=1 - world.rank, tag=tag)):
            with pytest.raises((TypeError, ValueError)) as info:
                call()
            errors.append(str(info.value))
        return errors

    for errors in ad.spawn(body, 2):
        assert errors[0].startswith("send: tag=") and errors[1].startswith("recv: tag=")
