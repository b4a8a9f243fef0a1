"""ONNX export of a model's generated torch path (`flexgen.interop.export.export_onnx`), checked against eager with
onnxruntime (fp64: 1e-12, spikes equal). Skipped without the `onnx` extra (`pip install ".[onnx]"`), which CI does
not install."""
import pytest
import torch

import flexgen
import flexgen.interop.export
from test_export import CPU_DEFAULT, inputs, make

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")


@pytest.mark.parametrize("name", ["lif", "dense", "chain"])
def test_onnx_file_equals_eager(tmp_path, name):
    ort = pytest.importorskip("onnxruntime")
    model = make(name, CPU_DEFAULT)  # the C target's ops are written as their torch path
    x = inputs(6)
    path = str(tmp_path / f"{name}.onnx")
    flexgen.interop.export.export_onnx(model, (x,), path)
    session = ort.InferenceSession(path)
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    flexgen.reset(model)
    expected = model(x).detach()
    assert expected.sum() > 0
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=1e-12)


def test_onnx_graph_holds_no_flexgen_op(tmp_path):
    import onnx

    path = str(tmp_path / "lif.onnx")
    flexgen.interop.export.export_onnx(make("lif", "torch"), (inputs(6),), path)
    domains = {node.domain for node in onnx.load(path).graph.node}
    assert not any("flexgen" in d for d in domains)
