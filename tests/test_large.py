"""More than 2**31 elements: kernel offsets are 64-bit. The generated sources (Triton and C) are checked
everywhere; a run beyond 2**31 elements needs a GPU (~32 GB of fp32 tensors)."""
import re

import pytest
import torch

import flexgen
from specs import lif

KERNEL_KINDS = ("forward", "inference", "backward", "forward_recompute", "backward_recompute")
ASSIGNMENT = re.compile(r"^\s*(\w+) = (.*?)(?:\s+#.*)?$")
INDEXES = ("offs", "row")  # every load and store address is base + row * stride + offs * stride


def narrow_indexes(source):
    """The index names (`INDEXES`) that some assignment in `source` computes without a 64-bit root: a name is
    64-bit where its expression holds `tl.int64` or a name already 64-bit."""
    wide, narrow = set(), set()
    for line in source.splitlines():
        match = ASSIGNMENT.match(line)
        if not match:
            continue
        name, expression = match.groups()
        used = set(re.findall(r"\b\w+\b", expression))
        if "tl.int64" in expression or used & wide - {name}:
            wide.add(name)
        elif name in INDEXES:
            narrow.add(name)
    return narrow


def generated_kernels():
    """(label, source) of every Triton kernel of the bundled neurons and of a recurrent layer."""
    kernels = []
    for name in flexgen.neurons.available():
        spec = flexgen.neurons.spec(name)
        kernels += [(f"{name} {kind}", spec.source(kind)) for kind in KERNEL_KINDS]
    layer = flexgen.Recurrent(flexgen.LIF, hidden=8, backend="torch")
    kernels += [(f"recurrent LIF {kind}", layer.source(kind)) for kind in ("forward", "backward", "replay")]
    return kernels


def test_every_kernel_addresses_memory_with_64_bit_offsets():
    kernels = generated_kernels()
    assert len(kernels) > 50
    for label, source in kernels:
        assert re.search(r"\boffs = ", source) and re.search(r"\brow = ", source), label
        assert narrow_indexes(source) == set(), label


def test_the_offset_check_finds_a_32_bit_offset():
    assert narrow_indexes("    offs = pid * BLOCK + tl.arange(0, BLOCK)\n") == {"offs"}
    assert narrow_indexes("    start = pid.to(tl.int64)\n    offs = start * BLOCK\n        row = step\n") == {"row"}


# The C target: every integer variable is int64_t but the flags (ints, never in an address), and every subscript and
# pointer offset is computed from int64_t names, BLOCK (a #define) and literals only, so no product of indexes is
# formed in 32 bits before it widens.
C_INTEGER = re.compile(r"\b(?:const\s+)?(unsigned|signed|short|long|int|u?int(?:8|16|32|64)_t|size_t|ptrdiff_t|char)"
                       r"\s+(\w+)\b")
C_FLAGS = {"THREADS", "SAVE", "STATE_SEQS"}
C_ADDRESSES = (re.compile(r"\w\s*\[([^\]]*)\]"), re.compile(r"\b\w+_ptr\s*\+\s*([^;:,)]*)"))


def narrow_c_indexes(source):
    """What in a generated C source could hold an address's index in fewer than 64 bits: a name declared with
    another integer type than int64_t (the flags aside), and a name in a subscript or pointer offset that is not
    declared int64_t (BLOCK aside)."""
    declared = {}
    for kind, name in C_INTEGER.findall(source):
        declared.setdefault(name, set()).add(kind)
    wide = {name for name, kinds in declared.items() if kinds == {"int64_t"}}
    narrow = {f"{name}: {' '.join(sorted(kinds))}" for name, kinds in declared.items()
              if name not in wide and name not in C_FLAGS}
    for address in C_ADDRESSES:
        for expression in address.findall(source):
            names = set(re.findall(r"\b[A-Za-z_]\w*\b", expression)) - {"BLOCK"}
            narrow |= {f"{name} in [{expression}]" for name in names - wide}
    return narrow


def test_the_c_target_addresses_memory_with_64_bit_offsets():
    """The C source of each bundled neuron (what `flexgen show NEURON --kernel c` prints); made without compiling."""
    sources = [(name, flexgen.neurons.spec(name).source("c")) for name in flexgen.neurons.available()]
    assert len(sources) > 10
    for name, source in sources:
        assert re.search(r"\bint64_t n_elem\b", source) and re.search(r"\bconst int64_t row = ", source), name
        assert re.search(r"\bfor \(int64_t offs = ", source) and re.search(r"\w+_ptr\[row \+ offs\]", source), name
        assert narrow_c_indexes(source) == set(), name


def test_the_c_offset_check_finds_a_32_bit_index():
    assert narrow_c_indexes("for (int offs = pid; offs < mask; ++offs) x_ptr[offs] = 0;") == {
        "offs: int", "offs in [offs]"}
    assert narrow_c_indexes("const int64_t offs = 0; const int32_t row = 1; y = x_ptr[row + offs];") == {
        "row: int32_t", "row in [row + offs]"}
    assert narrow_c_indexes("int64_t n_elem, int64_t step; s = x_ptr + step * n_elem + k;") == {
        "k in [step * n_elem + k]"}  # a pointer offset
    assert narrow_c_indexes("int64_t n_elem, int THREADS; s = x_ptr[THREADS * n_elem];") == {
        "THREADS in [THREADS * n_elem]"}  # a flag is an int: never in an address


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True])
def test_beyond_2_pow_31_elements(recompute):
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip("needs about 40 GB of free GPU memory")
    T, N = 2, 2**30 + 8  # T * N > 2**31: int32 offsets would wrap in the second step
    x = torch.empty(T, N, device="cuda").uniform_(0.0, 2.5).requires_grad_()
    (s,), _ = lif.apply(x, backend="triton", recompute=recompute)
    s.sum().backward()
    for cols in (slice(0, 4096), slice(N - 4096, N)):
        x_part = x.detach()[:, cols].clone().requires_grad_()
        (s_ref,), _ = lif.apply(x_part, backend="torch")
        s_ref.sum().backward()
        assert torch.equal(s[:, cols], s_ref)
        torch.testing.assert_close(x.grad[:, cols], x_part.grad, rtol=1e-6, atol=1e-6)
