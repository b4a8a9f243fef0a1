"""Walk through what flexgen generates for a LIF neuron: equations, saved set, kernels.

    python examples/explain_kernel.py

Nothing here runs a kernel, so no GPU is needed: printing the sources only
traces, differentiates and renders (the result is cached on disk, see
FLEXGEN_CACHE_DIR).
"""
import textwrap

import flexgen


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = flexgen.spike(h - v_th)
    return s, h * (1.0 - s)


def section(title, body=""):
    print(f"\n=== {title} ===")
    if body:
        print(textwrap.dedent(body).strip())


def main():
    compiled = lif.compiled()
    layout = compiled.layout

    section("1. the traced step", """
        flexgen called lif() once on symbols. Every operation became one line of a
        straight-line program; your local names (h, s) name the nodes, tmpN the rest.
    """)
    for line in lif.trace().program:
        print("   ", line)

    section("2. derived equations", """
        Reverse-mode differentiation, one node at a time. spike() is the Heaviside
        step forward; its derivative is the surrogate's (here Sigmoid(alpha=4):
        4*sigmoid(4z)*(1 - sigmoid(4z))).
    """)
    print(textwrap.indent(lif.equations(), "    "))

    section("3. the saved set", """
        Between forward and backward only memory carries values. flexgen picks the
        cheapest set of per-step values to keep (a minimum cut of the step's graph):
        an input or output is already in memory and costs one read in the backward,
        anything else one write in the forward and one read in the backward. All
        other values the backward needs are recomputed from the saved ones.
    """)
    why = {"input": "a per-step input, re-read from the input tensor",
           "output": "an output, re-read from the output tensor",
           "buffer": "written by the forward into a [T, N] buffer"}
    for item in layout.saved:
        print(f"    {item.name}: {why[item.kind.value]}")
    buffers = [item.name for item in layout.buffers]
    n_fwd = len(layout.inputs) + len(layout.outputs) + len(buffers)
    n_bwd = len(layout.saved) + len(layout.grad_outputs) + len(layout.grad_inputs)
    print(f"    per neuron and step: the training forward moves {n_fwd} values "
          f"(inputs {list(layout.inputs)}, outputs {list(layout.outputs)}, buffers {buffers}); "
          f"the backward {n_bwd} (saved, incoming gradients {list(layout.grad_outputs)}, "
          f"input gradients {list(layout.grad_inputs)}). States {list(layout.states)} stay in registers.")

    section("4. forward kernel (training)", """
        One program per BLOCK neurons; the time loop runs inside the kernel, so the
        state v never leaves registers between steps. The step body is the printed
        forward program; s is stored for the caller and h for the backward.
    """)
    print(lif.source("forward"))

    section("5. inference kernel", """
        The same loop without the saved buffers, used when no gradient is needed
        (torch.no_grad() or inputs that do not require grad).
    """)
    print(lif.source("inference"))

    section("6. backward kernel", """
        Backpropagation through time in one launch: the loop runs from the last step
        to the first, carrying grad_v (dL/dv after the step) in registers. Each step
        loads the saved h and the incoming grad_s, recomputes what it needs and
        stores grad_x. The equations are the ones of section 2 after common
        subexpression elimination (c, c1, ...).
    """)
    print(lif.source("backward"))

    section("7. where it lives", f"""
        The generated module is cached under its key {compiled.key[:16]}...: see
        {compiled.module.__file__}
        lif.source("module") prints the whole file, including the torch path that
        runs on the CPU (lif.source("torch_forward"), lif.source("torch_backward")).
    """)


if __name__ == "__main__":
    main()
