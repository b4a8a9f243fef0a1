"""Every backend against the eager oracle: outputs, states and all gradients."""
import math
import zlib

import pytest
import torch

from conftest import device_backends, max_rel_err
from specs import ALL, smooth

# The generated paths compute the oracle's expressions in another order (CSE, fused multiply-adds): float64
# agrees to rounding, float32 to its own rounding amplified over a few steps.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def rel_err(a, b):
    # Exact zeros in the oracle (cancelled terms) come back as rounding noise from fused arithmetic
    # (~1e-19 in fp64, up to ~1e-8 in fp32; the values themselves are O(1)): floor the scale there.
    return max_rel_err(a, b, floor=1e-2 if b.dtype == torch.float32 else 1e-3)


def stable_seed(*key):
    """The same seed in every process (hash() of a str changes with PYTHONHASHSEED)."""
    return zlib.crc32(repr(key).encode()) % 1000


def make_inputs(spec, T, shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(T, *shape, generator=g, dtype=dtype) * 1.5 + 0.7).to(device).requires_grad_() for _ in spec.signature.inputs]


def run_and_grad(spec, backend, inputs, states, params, seed, store_state_seqs=False):
    outputs, finals = spec.apply(*inputs, states=states, backend=backend, store_state_seqs=store_state_seqs, **params)
    g = torch.Generator().manual_seed(seed + 1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)).sum() for o in outputs)
    loss = loss + sum((f * torch.randn(f.shape, generator=g, dtype=f.dtype).to(f.device)).sum() for f in finals)
    leaves = list(inputs) + list(states) + [p for p in params.values() if isinstance(p, torch.Tensor)]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return outputs, finals, grads


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("T,shape", [(1, (5,)), (4, (2, 3)), (7, (19,))])
def test_matches_eager(device, backend, dtype, name, T, shape):
    spec = ALL[name]
    seed = stable_seed(name, T, shape)
    inputs = make_inputs(spec, T, shape, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 2)
    states = [(torch.rand(shape, generator=g, dtype=dtype) * 0.5).to(device).requires_grad_() for _ in spec.signature.states]
    params = {w: torch.tensor(-0.3, dtype=dtype, device=device, requires_grad=True) for w in spec.signature.learnable}
    got = run_and_grad(spec, backend, inputs, states, params, seed)
    ref = run_and_grad(spec, "eager", inputs, states, params, seed)
    tol = TOL[dtype]
    for a, b in zip(got[0], ref[0]):
        assert a.dtype == b.dtype and a.shape == b.shape
    spikes_got, spikes_ref = got[0][0], ref[0][0]
    assert torch.equal(spikes_got, spikes_ref), "spikes differ from the eager oracle"
    for a, b in zip(got[0][1:] + got[1], ref[0][1:] + ref[1]):
        assert rel_err(a, b) <= tol
    n_learnable = len(spec.signature.learnable)
    for k, (a, b) in enumerate(zip(got[2], ref[2])):
        assert a is not None and b is not None
        # A learnable parameter's gradient sums over every neuron and step: in fp32 the kernels' summation
        # order and autograd's differ, and the terms partly cancel.
        is_reduction = k >= len(got[2]) - n_learnable
        assert rel_err(a, b) <= (10 * tol if is_reduction and dtype == torch.float32 else tol)


@pytest.mark.parametrize("device,backend", device_backends())
def test_state_sequences(device, backend):
    spec = ALL["adaptive_mix"]
    inputs = make_inputs(spec, 5, (6,), torch.float64, device, 3)
    states = [torch.zeros(6, dtype=torch.float64, device=device, requires_grad=True) for _ in spec.signature.states]
    got = run_and_grad(spec, backend, inputs, states, {}, 3, store_state_seqs=True)
    ref = run_and_grad(spec, "eager", inputs, states, {}, 3, store_state_seqs=True)
    assert torch.equal(got[0][0], ref[0][0]) and got[0][0].sum() > 0, "spikes differ from the eager oracle"
    for a, b in zip(got[0][1:], ref[0][1:]):
        assert rel_err(a, b) <= TOL[torch.float64]
    for a, b in zip(got[1], ref[1]):
        assert a.shape == (5, 6)
        assert rel_err(a, b) <= TOL[torch.float64]
    for a, b in zip(got[2], ref[2]):
        assert rel_err(a, b) <= TOL[torch.float64]


@pytest.mark.parametrize("device,backend", device_backends())
def test_gradcheck(device, backend):
    """Finite differences agree with the generated backward (fp64, a neuron without spikes)."""
    spec = smooth
    n_in, n_st = len(spec.signature.inputs), len(spec.signature.states)

    def f(*args):
        inputs, states, (k,) = args[:n_in], args[n_in:n_in + n_st], args[n_in + n_st:]
        outputs, finals = spec.apply(*inputs, states=list(states), backend=backend, k=k)
        return tuple(outputs) + tuple(finals)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(n_in)]
    args += [torch.randn(4, generator=g, dtype=torch.float64) for _ in range(n_st)]
    args += [torch.tensor(0.7, dtype=torch.float64)]
    args = [a.to(device).requires_grad_() for a in args]
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("device,backend", device_backends())
def test_functions_of_constants_are_printed_as_values(device, backend):
    """Found by the property test on the GPU: sympy keeps tanh(1) exact, and torch.tanh(1.0) is an error."""
    import flexgen

    @flexgen.neuron(states=("s",))
    def constant_functions(x, s):
        return flexgen.abs(x), 2.0 * flexgen.tanh(flexgen.exp(0.0 * x)) + flexgen.sqrt(2.0) * s

    x = torch.randn(3, 4, dtype=torch.float64, device=device)
    got = constant_functions.apply(x, backend=backend)
    ref = constant_functions.apply(x, backend="eager")
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("device,backend", device_backends())
def test_integer_powers_of_negative_values(device, backend):
    """x**n is a product (n <= 16) or a signed |x|**n: exp(n log x) would be NaN for x < 0."""
    import flexgen

    @flexgen.neuron(states=("v",))
    def powers(x, v):
        return x ** 5 + 1e-3 * x ** 21 - 1e-3 * x ** 18, v + x ** 3

    x = (torch.linspace(-1.3, 1.2, 12, dtype=torch.float64).reshape(3, 4)).to(device).requires_grad_()
    got = powers.apply(x, backend=backend)
    ref = powers.apply(x, backend="eager")
    for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    grads = [torch.autograd.grad(r[0][0].sum() + r[1][0].sum(), x)[0] for r in (got, ref)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
    assert not grads[0].isnan().any()


def test_functions_of_parameters_are_computed_once_before_the_time_loop():
    """exp(-dt/tau) (ALIF's decay) and sigmoid(w) (PLIF's 1/tau, a learnable parameter) are computed
    before the loop in every kernel, under the step's own name where it has one (the fp16/bf16 forward's
    test of the saved values' comparisons still prints them whole)."""
    import flexgen
    from flexgen.neurons import zoo

    for spec, before_loop_code, call in ((zoo.alif, "alpha = tl.exp(-dt/tau)", "tl.exp("), (flexgen.PLIF.spec, "tl.sigmoid(w)", "tl.sigmoid(w)")):
        for kernel in ("forward", "inference", "backward", "forward_recompute", "backward_recompute"):
            before_loop, loop = spec.source(kernel).split("    for ", 1)
            loop = "\n".join(line for line in loop.splitlines() if "other_neighbour(" not in line)
            assert before_loop_code in before_loop and call not in loop.replace("tl.sigmoid(4.0", ""), (spec.name, kernel)
    assert "alpha = torch.exp(-dt/tau)" in zoo.alif.source("torch_forward").split("    for ")[0]


@pytest.mark.parametrize("device,backend", device_backends())
def test_an_output_of_parameters_alone_keeps_its_name_before_the_loop(device, backend):
    """`b` is an output computed from tau alone, like the step's `a`: both move before the time loop, and
    `b`, which the frame stores, keeps its name (a rename to `a` would leave the store without a value)."""
    import flexgen

    @flexgen.neuron(states=("v",))
    def twice(x, v, tau=2.0):
        a = flexgen.exp(-1.0 / tau)
        b = flexgen.exp(-1.0 / tau)
        h = v * a + x
        s = flexgen.spike(h - 1.0)
        return s, b, h * (1.0 - s)

    x = (torch.rand(5, 3, dtype=torch.float64) * 2).to(device).requires_grad_()
    results = []
    for b in (backend, "eager"):
        outputs, finals = twice.apply(x, backend=b)
        results.append([outputs[0], finals[0], *torch.autograd.grad(outputs[0].sum() + finals[0].sum(), x)])
        assert torch.allclose(outputs[1], torch.full_like(x, math.exp(-0.5)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_values_of_hyper_parameters_alone_get_no_gradient_and_no_saved_operands():
    """ALIF's decay alpha = exp(-dt/tau) depends on hyper-parameters only: its adjoint would need v and
    x at every step (h = alpha v + (1 - alpha) x), so computing it made the forward save x, v and a
    instead of h and a."""
    from flexgen.neurons import zoo

    derivation = zoo.alif.derivation()
    assert [str(s) for s in derivation.saved] == ["a", "h"]
    assert not any(str(a.target).startswith(("grad_alpha", "grad_rho")) for a in derivation.adjoint)


@pytest.mark.parametrize("device,backend", device_backends())
def test_divisions_by_parameters_become_reciprocals_computed_once(device, backend):
    """x / tau is x * inv_tau in the step, inv_tau = 1/tau before the time loop; a local named inv_tau keeps its name."""
    import flexgen

    @flexgen.neuron(states=("v",), learnable=("w",))
    def divided(x, v, tau=2.0, w=0.5):
        inv_tau = x / (tau * w) ** 2  # the user's own name, and a division by a product of parameters
        return inv_tau / v, v + (x - v) / tau + x / w + v / (1.0 + x * x)

    for kernel in ("forward", "inference", "backward", "torch_forward", "torch_backward"):
        before_loop, loop = divided.source(kernel).split("    for step")
        assert "inv_tau1 = 1.0/tau" in before_loop and "inv_w = 1.0/w" in before_loop
        assert "/tau" not in loop and "/w" not in loop and "inv_tau1" in loop
    assert "v/((x*x) + 1.0)" in divided.source("forward").split("for step")[1]  # not a parameter: still a division
    x = (torch.randn(5, 2, 3, dtype=torch.float64) * 0.5).to(device).requires_grad_()
    v0 = (torch.rand(2, 3, dtype=torch.float64) + 0.5).to(device).requires_grad_()
    w = torch.tensor([0.4, 0.7, 1.3], dtype=torch.float64, device=device, requires_grad=True)
    results = []
    for b in (backend, "eager"):
        outputs, finals = divided.apply(x, states=[v0], backend=b, tau=1.75, w=w)  # exact in fp32: kernels get hyper-parameters as fp32 scalars
        loss = (outputs[0] * torch.linspace(-1, 1, outputs[0].numel(), dtype=x.dtype, device=device).view_as(outputs[0])).sum() + finals[0].sum()
        results.append([*outputs, *finals, *torch.autograd.grad(loss, [x, v0, w])])
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
