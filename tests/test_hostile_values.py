"""Values a hyper-parameter, a constant or an option cannot hold give a SpecError naming the parameter or the
line, never a raw OverflowError, ValueError or TypeError, nor a silent conversion."""

import numpy
import pytest
import torch

import flexgen
from flexgen import spike
from conftest import line_of


pytestmark = pytest.mark.usefixtures("private_cache")


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = spike(h - v_th)
    return s, h * (1.0 - s)


# ---------------------------------------------------------------- hyper-parameters given as tensors


@pytest.mark.parametrize("make", [lambda **p: lif(**p), lambda **p: lif.apply(torch.ones(2, 3), **p)],
                         ids=["layer", "apply"])
def test_hyper_parameter_tensor_that_requires_grad_points_to_learnable(make):
    with pytest.raises(flexgen.SpecError, match=r"hyper-parameter 'tau' was given a tensor that requires grad.*"
                                                r"learnable=\('tau',\)"):
        make(tau=torch.tensor(3.0, requires_grad=True))


@pytest.mark.parametrize("make", [lambda **p: lif(**p), lambda **p: lif.apply(torch.ones(2, 3), **p)],
                         ids=["layer", "apply"])
def test_hyper_parameter_vector_names_it_and_points_to_per_channel(make):
    message = r"hyper-parameter 'tau' was given a tensor of shape \(2,\).*per_channel"
    with pytest.raises(flexgen.SpecError, match=message):
        make(tau=torch.tensor([2.0, 3.0]))


def test_hyper_parameter_from_a_plain_one_element_tensor_is_its_value():
    assert lif(tau=torch.tensor(3.0)).hyper["tau"] == 3.0
    assert lif(tau=torch.tensor([4.0])).hyper["tau"] == 4.0


@pytest.mark.parametrize("value", ["3", True, None, [2.0]], ids=["str", "bool", "None", "list"])
def test_hyper_parameter_that_is_not_a_number_is_refused_by_name(value):
    with pytest.raises(flexgen.SpecError, match="hyper-parameter 'tau' must be a number"):
        lif(tau=value)


# ---------------------------------------------------------------- numbers beyond the float range


def test_huge_hyper_parameter_argument_names_the_parameter():
    with pytest.raises(flexgen.SpecError, match="hyper-parameter 'tau' is an integer of 1329 bits"):
        lif(tau=10**400)
    with pytest.raises(flexgen.SpecError, match="hyper-parameter 'v_th' is inf"):
        lif.apply(torch.ones(2, 3), v_th=float("inf"))


def test_huge_hyper_parameter_default_names_the_parameter():
    def big_tau(x, v, tau=10**400):
        return x / tau, v

    with pytest.raises(flexgen.SpecError, match=r"'big_tau' \(.*\): default of 'tau' is an integer of 1329 bits"):
        flexgen.neuron(states=("v",))(big_tau)


@pytest.mark.parametrize("exponent", [531441, 2000])
def test_integer_constant_beyond_the_float_range_names_the_line(exponent):
    def power(x, v):
        return x * 3 ** exponent, v

    spec = flexgen.neuron(states=("v",))(power)
    with pytest.raises(flexgen.SpecError, match=rf"integer constant of \d+ bits is beyond the float range.*\n  at .*:"
                                                rf"{line_of(power, '3 ** exponent')}:"):
        spec.trace()


class KeyIsNotAMethod:
    key = 3


def test_default_with_a_non_callable_key_is_not_an_option():
    def step(x, v, mode=KeyIsNotAMethod()):
        return x, v

    with pytest.raises(flexgen.SpecError, match="default of 'mode' is a KeyIsNotAMethod"):
        flexgen.neuron(states=("v",))(step)


def test_option_given_a_value_without_a_key_method_names_the_option():
    with pytest.raises(flexgen.SpecError, match="option 'surrogate' takes None, a bool, a str or an object with a key"):
        flexgen.neurons.alif(surrogate=KeyIsNotAMethod())


# ---------------------------------------------------------------- integers floats do not hold exactly

def test_an_integer_exponent_beyond_two_to_the_53_is_refused_at_its_line():
    def huge_power(x, v):
        h = (v + x) ** (10 ** 30)
        return h, h * 0.5

    spec = flexgen.neuron(states=("v",))(huge_power)
    with pytest.raises(flexgen.SpecError, match=rf"integer constant 10{{30}} is larger than 2\*\*53.*write it as a "
                                                rf"float \(1e\+30\)\n  at .*:{line_of(huge_power, '10 ** 30')}:"):
        spec(backend="torch")


def test_an_integer_of_two_to_the_53_is_still_exact_on_every_path():
    @flexgen.neuron(states=("v",))
    def exact_power(x, v):
        return x * 2 ** 53 - x * 9007199254740992.0, v

    x = torch.rand(3, 2, dtype=torch.float64)
    for backend in ("eager", "torch"):
        assert torch.equal(exact_power.apply(x, backend=backend)[0][0], torch.zeros_like(x))


def test_recurrent_width_takes_numpy_integers_and_names_the_size_it_cannot_allocate():
    layer = flexgen.Recurrent(flexgen.LIF, hidden=numpy.int64(4), backend="torch")
    assert layer.hidden == 4 and type(layer.hidden) is int and layer.weight.shape == (4, 4)
    with pytest.raises(MemoryError, match=r"hidden=1000000\) needs a \[1000000, 1000000\] recurrent weight, 3,725.3 GiB "
                                          r"in float32, more than this machine has"):
        flexgen.Recurrent(flexgen.LIF, hidden=10**6, backend="torch")  # checked before anything is allocated
    for bad in (True, 2.0, 0, -3, numpy.float64(4.0)):
        with pytest.raises(ValueError, match="hidden must be a positive number of neurons"):
            flexgen.Recurrent(flexgen.LIF, hidden=bad, backend="torch")


@pytest.mark.parametrize("threshold,fires", [(True, "at every step"), (False, "never")])
def test_a_constant_ode_threshold_says_it_must_depend_on_the_states(threshold, fires):
    def constant(x, v):
        return flexgen.Dynamics({"v": x - v}, threshold=threshold, reset={"v": 0.0})

    with pytest.raises(flexgen.SpecError, match=rf"threshold is always {threshold} \(the neuron would fire {fires}\); "
                                                r"it must depend on the states, e.g. `v >= v_th`"):
        flexgen.ode(states=("v",))(constant)
