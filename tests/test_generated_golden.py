"""The generated sources of every bundled neuron, pinned by hash.

A refactor of the generator must leave them byte for byte as they are; a change
that means to alter generated code updates `golden/generated.json` with
`python test_generated_golden.py --update` and says why in its commit.
Printed sympy text can differ between sympy releases: pyproject pins the range
flexgen supports, and a sympy other than the one the hashes were recorded with
fails here with the command that records them again (after reading the diff).
"""
import hashlib
import json
import pathlib
import sys

import pytest
import sympy

import flexgen
import specs

GOLDEN = pathlib.Path(__file__).parent / "golden" / "generated.json"
KINDS = ("module", "forward", "inference", "backward", "forward_recompute", "backward_recompute",
         "torch_forward", "torch_backward", "c")


def pinned_specs():
    bundled = {name: flexgen.neurons.spec(name) for name in flexgen.neurons.available()}
    return {**bundled, **{f"tests.{name}": spec for name, spec in specs.ALL.items()}, "tests.smooth": specs.smooth}


def digest(text):
    return hashlib.sha256(text.encode()).hexdigest()


def generated(spec):
    texts = {kind: spec.source(kind) for kind in KINDS}
    texts["equations"] = spec.equations()
    return {kind: digest(text) for kind, text in texts.items()}


def recorded():
    return json.loads(GOLDEN.read_text())


def test_every_pinned_spec_is_recorded():
    assert sorted(recorded()["specs"]) == sorted(pinned_specs())


@pytest.mark.parametrize("name", sorted(pinned_specs()))
def test_generated_sources_unchanged(name):
    golden = recorded()
    assert golden["sympy"] == sympy.__version__, (
        f"the hashes were recorded with sympy {golden['sympy']}, this is {sympy.__version__}: check the generated "
        "sources under this sympy, then record them with `python tests/test_generated_golden.py --update`")
    assert generated(pinned_specs()[name]) == golden["specs"][name]


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    table = {name: generated(spec) for name, spec in sorted(pinned_specs().items())}
    GOLDEN.write_text(json.dumps({"sympy": sympy.__version__, "specs": table}, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(table)} specs in {GOLDEN}")
