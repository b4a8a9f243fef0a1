"""A comparison where a number is expected (spike's argument, arithmetic, math functions): a SpecError that names
the line and the fix, never an error from deep inside the derivation."""
import os

import pytest
import torch

import flexgen
from flexgen import spike
from conftest import line_of


pytestmark = pytest.mark.usefixtures("private_cache")


def spike_of_greater(x, v, v_th=1.0):
    h = v + x
    s = spike(h > v_th)
    return s, h * (1.0 - s)


def spike_of_ge(x, v, v_th=1.0):
    h = v + x
    s = spike(flexgen.ge(h, v_th), surrogate=flexgen.surrogate.ATan())
    return s, h * (1.0 - s)


def times_one(x, v, v_th=1.0):
    h = v + x
    s = (h >= v_th) * 1.0
    return s, h * (1.0 - s)


def plus_zero(x, v, v_th=1.0):
    h = v + x
    s = 0.0 + (h >= v_th)
    return s, h * (1.0 - s)


def negated(x, v, v_th=1.0):
    h = v + x
    return -(h < v_th), h


def exp_of(x, v, v_th=1.0):
    h = v + x
    return flexgen.exp(h >= v_th), h


def where_value(x, v, v_th=1.0):
    h = v + x
    return flexgen.where(x > 0, h > v_th, 0.0), h


SPIKE_FIX = ["spike() got a comparison", "spike(h - v_th)", "flexgen.where(h >= v_th, 1.0, 0.0)"]
ARITHMETIC_FIX = ["got a comparison", "flexgen.where(cond, 1.0, 0.0)", "flexgen.spike(h - v_th)"]
CASES = {
    "spike(h > v_th)": (spike_of_greater, "spike(h > v_th)", SPIKE_FIX),
    "spike(ge(h, v_th))": (spike_of_ge, "flexgen.ge", SPIKE_FIX),
    "(h >= v_th) * 1.0": (times_one, "* 1.0", ["`*` got a comparison", *ARITHMETIC_FIX]),
    "0.0 + (h >= v_th)": (plus_zero, "0.0 +", ["`+` got a comparison", *ARITHMETIC_FIX]),
    "-(h < v_th)": (negated, "-(h", ["unary `-` got a comparison", *ARITHMETIC_FIX]),
    "exp(h >= v_th)": (exp_of, "flexgen.exp", ["flexgen.exp() got a comparison", *ARITHMETIC_FIX]),
    "where(c, h > v_th, 0)": (where_value, "h > v_th, 0.0", ["flexgen.where(cond, a, b) as a or b"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_comparison_used_as_a_number_names_the_line_and_the_fix(name, private_cache):
    fn, marker, fragments = CASES[name]
    spec = flexgen.neuron(states=("v",))(fn)
    with pytest.raises(flexgen.SpecError) as info:
        spec()
    message = str(info.value)
    for fragment in fragments + [f"{__file__}:{line_of(fn, marker)}"]:
        assert fragment in message, message
    assert not os.path.exists(private_cache) or not any(n for n in os.listdir(private_cache) if not n.startswith("."))


def test_conditions_still_work_where_they_belong():
    @flexgen.neuron(states=("v",))
    def gated(x, v, v_th=1.0):
        h = v + x
        s = spike(h - v_th)
        keep = flexgen.where((h < 2.0 * v_th) & ~(x < -1.0), 1.0, 0.0)
        return s, h * (1.0 - s) * keep

    x = torch.tensor([[0.5], [0.7], [2.5]], dtype=torch.float64)
    assert gated(backend="torch")(x).flatten().tolist() == [0.0, 1.0, 1.0]


def test_spike_of_a_bool_tensor_is_refused_in_eager_code():
    """On tensors (the eager backend) spike(h > v_th) would fire everywhere: (False >= 0) holds."""
    with pytest.raises(flexgen.SpecError, match=r"spike\(\) got a bool tensor.*spike\(h - v_th\)"):
        spike(torch.tensor([0.5, 1.5]) > 1.0)


def test_custom_surrogate_primitive_must_not_be_a_comparison():
    with pytest.raises(ValueError, match=r"primitive returned a comparison \(z > 0\).*smooth function of z"):
        flexgen.surrogate.Custom(lambda z: z > 0)
