"""Generated names never meet the user's: a spec name equal to one the kernels make from
another spec name is a SpecError naming both; local variables, gradients and helper names are allocated
around everything the frames derive."""
import ast

import pytest
import torch

import flexgen
from conftest import plain_device_backends
from flexgen import spike
from flexgen.frontend.names import DERIVED_FORMS, check_derived_collisions, derived_forms


pytestmark = pytest.mark.usefixtures("private_cache")


def learnable_and_its_size(x, v, a=0.5, a_size=2.0):
    h = v + (x - v) * a * a_size
    return spike(h - 1.0), h


def state_and_an_input_named_like_its_checkpoints(x, v_ckpt, v):
    return x + v_ckpt, v + x


def state_and_its_checkpoints_pointer(x, v, v_ckpt_ptr=1.0):
    return x * v_ckpt_ptr, v + x


@pytest.mark.parametrize("step,learnable,message", [
    (learnable_and_its_size, ("a",), "'a_size' is what the generated kernels call the channel count of the learnable "
                                      "parameter 'a'"),
    (state_and_an_input_named_like_its_checkpoints, (), "'v_ckpt' is what the generated kernels call the recompute "
                                                         "checkpoints of the state 'v'"),
])
def test_spec_name_equal_to_a_generated_one_is_refused_naming_both(step, learnable, message):
    spec = flexgen.neuron(states=("v",), learnable=learnable)(step)
    with pytest.raises(flexgen.SpecError, match=rf"'{step.__name__}' \(.*\): parameter name {message}; rename one"):
        spec.trace()


def test_reserved_suffixes_stay_refused_by_the_name_check():
    with pytest.raises(flexgen.SpecError, match="clashes with a name the generated kernels use"):
        flexgen.neuron(states=("v",))(state_and_its_checkpoints_pointer)


def test_learnable_alpha_joins_the_collision_check():
    with pytest.raises(flexgen.SpecError, match="'surrogate_alpha_size' is what the generated kernels call the channel "
                                                "count of the learnable parameter 'surrogate_alpha'"):
        check_derived_collisions({"learnable parameter": ["surrogate_alpha"]}, ["x", "surrogate_alpha_size"])


@flexgen.neuron(states=("v",), learnable=("w",))
def adversarial(grad, inv, v, w=0.5, sn=2.0, ptr=4.0):
    """Names the frames also make from other names: the output `st` has the gradient `grad_st`, input grad's
    time stride; the reciprocals of `sn` and `ptr` would be `inv_sn` and `inv_ptr`, input inv's neuron stride
    and pointer; `v_ckpt` is state v's checkpoint buffer, `w_size` and `w_inner` learnable w's channel count and
    stride."""
    v_ckpt = v + (grad / sn - v) * w
    st = v_ckpt * inv / ptr
    io = spike(v_ckpt - 1.0)
    w_size = io * 0.5 + st
    w_inner = w_size / sn
    return st, io, w_inner, v_ckpt * (1.0 - io)


def overwritten_arguments(source, may_assign):
    """(function, name) for every argument of a function in `source` that its body assigns, `may_assign` aside."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, ast.FunctionDef):
            arguments = {a.arg for a in function.args.args}
            for node in ast.walk(function):
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id in arguments - set(may_assign):
                        found.append((function.name, target.id))
    return found


def test_adversarial_names_never_overwrite_a_kernel_argument():
    """Every name the kernels take is read as given; only the hyper-parameters are cast in place."""
    hyper = adversarial.compiled().layout.hyper
    for kind in ("module", "torch_forward", "torch_backward"):
        assert overwritten_arguments(adversarial.source(kind), hyper) == [], kind


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_adversarial_names_match_eager(device, backend):
    g = torch.Generator().manual_seed(7)
    inputs = [(torch.rand(5, 2, 3, generator=g, dtype=torch.float64) + 0.5).to(device) for _ in range(2)]
    w = torch.tensor(0.5, dtype=torch.float64, device=device)

    def run(backend, recompute=False):
        xs = [x.clone().requires_grad_() for x in inputs]
        ws = w.clone().requires_grad_()
        outputs, (v,) = adversarial.apply(*xs, backend=backend, recompute=recompute, w=ws)
        loss = sum((o * (k + 1)).sum() for k, o in enumerate(outputs)) + v.sum()
        return [*outputs, v, *torch.autograd.grad(loss, [*xs, ws])]

    ref = run("eager")
    for recompute in (False, True):
        for got, want in zip(run(backend, recompute), ref):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_derived_forms_cover_every_role():
    forms = derived_forms(["n"])
    for role_forms in DERIVED_FORMS.values():
        assert {form.format("n") for form in role_forms} <= forms
