"""Hostile and unsupported specs: a clear SpecError naming the construct and line, and no code emitted."""
import math
import os

import numpy
import pytest
import torch

import flexgen
from conftest import TRITON_DEVICE, line_of
from flexgen import cache
from flexgen.frontend.names import check_spec_name, sanitize_identifier


pytestmark = pytest.mark.usefixtures("private_cache")


def emitted(root):
    """Generated files under the cache root (lock files and the root's marker are not code)."""
    return [f for _, _, files in os.walk(root) for f in files if not f.startswith(".lock-") and f != cache.MARKER_FILE]


def assert_rejected(make, *fragments, private_cache=None):
    """`make()` builds a spec and compiles it; it must raise SpecError mentioning every fragment."""
    with pytest.raises(flexgen.SpecError) as info:
        make()
    message = str(info.value)
    for fragment in fragments:
        assert str(fragment) in message, message
    return message


# ---------------------------------------------------------------- unsupported constructs in the step


def step_if(x, v):
    if x > v:
        return x, v
    return v, x


def step_while(x, v):
    while v < 1.0:
        v = v + x
    return x, v


def step_math(x, v):
    return math.exp(x), v


def step_torch(x, v):
    return torch.exp(x), v


def step_numpy(x, v):
    return numpy.exp(x), v


def step_torch_erf(x, v):
    return torch.erf(x), v


def step_numpy_arctan(x, v):
    return numpy.arctan(x), v


def step_tensor_of_hyper(x, v, tau=2.0):
    return x, v + x / torch.tensor(tau)


def step_inplace(x, v):
    x.add_(1.0)
    return x, v


def step_returns_one(x, v):
    return v


CONSTRUCTS = {
    "if": (step_if, "if x > v", ["`if`", "flexgen.where"]),
    "while": (step_while, "while v", ["`while` loop", "flexgen.where"]),
    "math.exp": (step_math, "math.exp", ["math.exp()", "flexgen math functions"]),
    "torch.exp": (step_torch, "torch.exp", ["torch.exp", "flexgen.exp"]),
    "numpy.exp": (step_numpy, "numpy.exp", ["numpy.exp", "use flexgen.exp instead"]),
    "torch.erf": (step_torch_erf, "torch.erf", ["torch.erf is not supported", "flexgen has no erf",
                                                 "flexgen.exp, flexgen.log"]),
    "numpy.arctan": (step_numpy_arctan, "numpy.arctan", ["use flexgen.atan instead"]),
    "torch.tensor": (step_tensor_of_hyper, "torch.tensor", ["torch.tensor() was called on a traced value",
                                                            "use it directly (`x / tau`, not `x / torch.tensor(tau)`)",
                                                            "flexgen.exp(tau)"]),
    "in-place": (step_inplace, "add_", ["in-place", ".add_()"]),
    "returns": (step_returns_one, "return v", ["returned 1 value(s)", "at least 2 values"]),
}


@pytest.mark.parametrize("name", sorted(CONSTRUCTS))
def test_unsupported_construct_names_itself_and_its_line(name, private_cache):
    fn, marker, fragments = CONSTRUCTS[name]
    spec = flexgen.neuron(states=("v",))(fn)
    assert_rejected(spec.compiled, *fragments, f":{line_of(fn, marker)}")
    assert emitted(private_cache) == []


def test_augmented_assignment_rebinds_and_is_fine():
    @flexgen.neuron(states=("v",))
    def rebinding(x, v):
        x += 1.0
        v *= 0.5
        return x, v + x

    x = torch.rand(3, 2, dtype=torch.float64)
    outputs, finals = rebinding.apply(x, backend="torch")
    v = torch.zeros(2, dtype=torch.float64)
    for t in range(3):
        v = v * 0.5 + (x[t] + 1.0)
    assert torch.equal(outputs[0], x + 1.0) and torch.allclose(finals[0], v)


# ---------------------------------------------------------------- the signature


def decorate(fn, **kwargs):
    return lambda: flexgen.neuron(**kwargs)(fn).compiled()


def plain(x, v):
    return x, v


def with_nan(x, v, a=float("nan")):
    return x * a, v


def with_inf(x, v, a=float("inf")):
    return x * a, v


def with_list(x, v, a=[1.0]):  # noqa: B006 (the point of the test)
    return x, v


def with_args(x, v, *rest):
    return x, v


def with_kwargs(x, v, **rest):
    return x, v


def with_bad_parameter_name(x, v, tl=1.0):
    return x * tl, v


SIGNATURES = {
    "state with code": (plain, {"states": ("v; import os",)}, ["'v; import os'", "not a valid Python identifier"]),
    "state with quote": (plain, {"states": ("v'\"",)}, ["not a valid Python identifier"]),
    "state with newline": (plain, {"states": ("v\nimport os",)}, ["not a valid Python identifier"]),
    "state not a parameter": (plain, {"states": ("w",)}, ["'w' is not a parameter"]),
    "state twice": (plain, {"states": ("v", "v")}, ["more than once"]),
    "learnable with code": (plain, {"states": ("v",), "learnable": ("w)",)}, ["not a valid Python identifier"]),
    "init value with newline": (plain, {"states": ("v",), "init": {"v": "x\n"}}, ["init of 'v'", "'x\\n'"]),
    "init for unknown state": (plain, {"states": ("v",), "init": {"v;": 1.0}}, ["not a state"]),
    "init nan": (plain, {"states": ("v",), "init": {"v": float("nan")}}, ["finite number"]),
    "nan default": (with_nan, {"states": ("v",)}, ["default of 'a' is nan", "finite"]),
    "inf default": (with_inf, {"states": ("v",)}, ["default of 'a' is inf", "finite"]),
    "list default": (with_list, {"states": ("v",)}, ["default of 'a' is a list"]),
    "*args": (with_args, {"states": ("v",)}, ["*args/**kwargs", "*rest"]),
    "**kwargs": (with_kwargs, {"states": ("v",)}, ["*args/**kwargs", "**rest"]),
    "reserved name": (with_bad_parameter_name, {"states": ("v",)}, ["'tl'", "clashes with a name the generated kernels use"]),
}


@pytest.mark.parametrize("case", sorted(SIGNATURES))
def test_bad_signature_is_refused_with_its_location(case, private_cache):
    fn, kwargs, fragments = SIGNATURES[case]
    assert_rejected(decorate(fn, **kwargs), *fragments, f":{fn.__code__.co_firstlineno}")
    assert emitted(private_cache) == []


@pytest.mark.parametrize("name", ["inputs", "states", "like", "step", "n_elem", "x_ptr", "grad_x", "h_io", "v_seen", "other_neighbour",
                                  "match", "print", "_v", "ﬁ"])
def test_names_the_templates_use_are_reserved(name):
    with pytest.raises(flexgen.SpecError):
        check_spec_name(name, "state")


def test_sanitized_identifiers_are_plain_ascii():
    for raw in ["<lambda>", "a'b\"c;\nimport os", "τ_neuron", "", "9lives", "class", "x" * 300]:
        name = sanitize_identifier(raw)
        assert name.isidentifier() and name.isascii() and len(name) <= 70
        assert not __import__("keyword").iskeyword(name)


def test_lambda_spec_works_and_its_kernel_name_is_sanitised():
    spec = flexgen.neuron(states=("v",))(lambda x, v: (x, v + x))
    assert spec.name == "lambda_"
    for backend, device in (("torch", "cpu"), ("triton", TRITON_DEVICE)):
        x = torch.rand(3, 4, dtype=torch.float64, device=device)
        outputs, finals = spec.apply(x, backend=backend)
        assert torch.equal(outputs[0], x) and torch.allclose(finals[0], x.sum(0))
    assert "def lambda__forward(" in spec.source("module")


def test_hostile_function_name_is_sanitised():
    def step(x, v):
        return x, v

    step.__name__ = "x'); import os; os.system('true') #\n"
    spec = flexgen.neuron(states=("v",))(step)
    source = spec.source("module")
    assert "import os" not in source and "os.system" not in source
    compile(source, "generated", "exec")


# ---------------------------------------------------------------- constants and closures


def test_non_finite_constant_in_the_step_is_refused():
    def step(x, v):
        return x * float("inf"), v

    assert_rejected(decorate(step, states=("v",)), "not finite", f":{line_of(step, 'inf')}")


def test_huge_constant_works_when_representable():
    @flexgen.neuron(states=("v",))
    def huge(x, v):
        return x * 1e308, v + x

    x = torch.rand(3, 2, dtype=torch.float64)
    got, ref = huge.apply(x, backend="torch")[0][0], huge.apply(x, backend="eager")[0][0]
    assert torch.equal(got, ref)


def test_constant_folded_beyond_float_range_is_refused(private_cache):
    @flexgen.neuron(states=("v",))
    def overflowing(x, v):
        big = v * 0.0 + 1e308  # v * 0.0 folds to 0 while tracing, so big is a constant
        return x * (big * 10.0), v

    assert_rejected(overflowing.compiled, "beyond the float range")
    assert cache.info()["count"] == 0 and emitted(private_cache) == []


def test_product_of_constants_written_in_steps_is_computed_in_steps():
    """`x * 1e308 * 10.0` is not folded to `1e309 * x`, beyond the float range: the kernels multiply as written."""

    @flexgen.neuron(states=("v",))
    def in_steps(x, v):
        h = x * 1e308
        return h * 10.0, v

    x = torch.tensor([[1e-10, -1e-10, 0.5]], dtype=torch.float64)
    ref = in_steps.apply(x, backend="eager")[0][0]
    assert torch.equal(in_steps.apply(x, backend="torch")[0][0], ref)
    assert torch.equal(ref, x * 1e308 * 10.0)


def make_tensor_closure():
    weight = torch.ones(3)

    def step(x, v):
        return x * weight, v

    return step


def make_helper_closure():
    weight = torch.ones(3)

    def helper(z):
        return weight * z

    def step(x, v):
        return helper(x), v

    return step


def test_closure_over_a_tensor_is_refused_by_name(private_cache):
    step = make_tensor_closure()
    assert_rejected(decorate(step, states=("v",)), "'weight'", "torch.Tensor", "enclosing function", f":{step.__code__.co_firstlineno}")
    helper_step = make_helper_closure()
    assert_rejected(decorate(helper_step, states=("v",)), "torch.Tensor", f":{line_of(helper_step, 'helper(x)')}")
    assert emitted(private_cache) == []


def make_float_closure(gain):
    @flexgen.neuron(states=("v",))
    def scaled(x, v):
        return x * gain, v + gain

    return scaled


def test_closure_over_a_float_is_baked_in_and_keys_the_cache():
    a, b = make_float_closure(0.25), make_float_closure(0.75)
    assert "0.25" in a.trace().text() and "0.75" in b.trace().text()
    assert a.compiled().key != b.compiled().key
    x = torch.rand(2, 3, dtype=torch.float64)
    assert torch.equal(a.apply(x, backend="torch")[0][0], x * 0.25)
    assert torch.equal(b.apply(x, backend="torch")[0][0], x * 0.75)


def test_common_short_names_stay_available():
    """Names such as `i` or `t` are ordinary input names: the kernels' own loop variables do not take them."""

    @flexgen.neuron(states=("v",))
    def step_with_short_names(i, t, v):
        return v + i, v + t

    outputs, (v,) = step_with_short_names.apply(torch.ones(2, 3), torch.ones(2, 3), backend="torch")
    assert torch.equal(v, torch.full((3,), 2.0))
