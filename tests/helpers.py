"""Small model builders and assertions shared by the conversion tests.

Everything here works on `onnx.ModelProto` (the converted `onnx_ir` model is serialised with
`onnx_ir.to_proto`), so the structure is checked independently of mixprec's own IR view:
element types come from ONNX shape inference in strict mode, not from the converter.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import onnx.parser
import onnx.shape_inference
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto

import mixprec
from mixprec.validate.emulate import emulate_low_precision

FLOAT = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16
BFLOAT16 = TensorProto.BFLOAT16
INT64 = TensorProto.INT64
BOOL = TensorProto.BOOL
LOW_TYPES = {"float16": FLOAT16, "bfloat16": BFLOAT16}
FLOAT_TYPES = frozenset({FLOAT, FLOAT16, BFLOAT16, TensorProto.DOUBLE})
_NUMPY = {FLOAT: np.float32, FLOAT16: np.float16, BFLOAT16: ml_dtypes.bfloat16}
_ORT_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}

# -- building and converting ------------------------------------------------------------------


def parse(text: str, *, check: bool = True) -> onnx.ModelProto:
    """Parse a model in ONNX text syntax (and check that it is a valid FP32 model)."""
    model = onnx.parser.parse_model(text)
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def convert(model: onnx.ModelProto, **kwargs) -> tuple[mixprec.ConversionResult, onnx.ModelProto]:
    """Convert a copy of `model` (no validation unless asked) and serialise the result.

    The `onnx` runtime profile (the schema alone) unless asked: the rules under test are the
    converter's, not one runtime's kernel gaps.
    """
    kwargs.setdefault("validate", "none")
    kwargs.setdefault("runtime", "onnx")
    result = mixprec.convert(copy.deepcopy(model), **kwargs)
    return result, ir.to_proto(result.model)


# -- walking a proto --------------------------------------------------------------------------


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and all its subgraphs (depth first)."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from iter_graphs(sub)


def iter_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of the model, subgraphs included."""
    for graph in iter_graphs(model.graph):
        yield from graph.node


def _value_info_type(vi: onnx.ValueInfoProto) -> int | None:
    if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
        return vi.type.tensor_type.elem_type
    return None


def infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """Strict ONNX shape inference with type checking: raises if any binding disagrees."""
    return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every named tensor, from strict shape inference (subgraphs included).

    Names are assumed unique across the model (SSA), which the ONNX checker enforces for the
    main graph; subgraph-local names that shadow nothing are merged in.
    """
    inferred = infer(model)
    types: dict[str, int] = {}
    for graph in iter_graphs(inferred.graph):
        for init in graph.initializer:
            types[init.name] = init.data_type
        for vi in (*graph.input, *graph.output, *graph.value_info):
            t = _value_info_type(vi)
            if t is not None:
                types[vi.name] = t
        for node in graph.node:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value":
                        types[node.output[0]] = attr.t.data_type
    return types


@dataclass(frozen=True)
class NodeSig:
    """(op_type, input element types, output element types) of one node."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __repr__(self) -> str:
        return f"{self.op_type}({', '.join(self.inputs)}) -> ({', '.join(self.outputs)})"


def type_name(elem_type: int | None) -> str:
    """Short name of an element type: 'float', 'float16', 'int64', ... ('' for absent)."""
    if elem_type is None:
        return "?"
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name if elem_type not in (
        FLOAT, FLOAT16, BFLOAT16
    ) else {FLOAT: "float", FLOAT16: "float16", BFLOAT16: "bfloat16"}[elem_type]


def node_sigs(model: onnx.ModelProto, graph: onnx.GraphProto | None = None) -> list[NodeSig]:
    """Per node (main graph by default, in order): op type, input and output element types."""
    types = value_types(model)
    graph = graph if graph is not None else model.graph

    def t(name: str) -> str:
        return "" if not name else type_name(types.get(name))

    return [
        NodeSig(n.op_type, tuple(t(i) for i in n.input), tuple(t(o) for o in n.output))
        for n in graph.node
    ]


def all_node_sigs(model: onnx.ModelProto) -> list[NodeSig]:
    """`node_sigs` of every graph of the model, subgraphs included (depth first)."""
    out: list[NodeSig] = []
    for graph in iter_graphs(model.graph):
        out.extend(node_sigs(model, graph))
    return out


def sigs_of(model: onnx.ModelProto, op_type: str) -> list[NodeSig]:
    """The signatures of all nodes of one op type (subgraphs included)."""
    return [s for s in all_node_sigs(model) if s.op_type == op_type]


def casts(model: onnx.ModelProto) -> list[tuple[str, int]]:
    """(input name, `to`) of every Cast node, subgraphs included, in order."""
    out = []
    for node in iter_nodes(model):
        if node.op_type == "Cast":
            to = next(a.i for a in node.attribute if a.name == "to")
            out.append((node.input[0], to))
    return out


def cast_targets(model: onnx.ModelProto) -> list[int]:
    """The `to` of every Cast, in order."""
    return [to for _, to in casts(model)]


def producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto | None:
    """The node producing `name` (subgraphs included)."""
    for node in iter_nodes(model):
        if name in node.output:
            return node
    return None


def consumers(model: onnx.ModelProto, name: str) -> list[onnx.NodeProto]:
    """Nodes reading `name` (subgraphs included)."""
    return [n for n in iter_nodes(model) if name in n.input]


def node_named(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    """The node with this name."""
    for node in iter_nodes(model):
        if node.name == name:
            return node
    raise KeyError(name)


def initializer_types(model: onnx.ModelProto) -> dict[str, int]:
    """Initializer name -> element type (all graphs)."""
    return {i.name: i.data_type for g in iter_graphs(model.graph) for i in g.initializer}


def io_types(model: onnx.ModelProto) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(name, element type) of the model's inputs and of its outputs."""
    ins = [(v.name, v.type.tensor_type.elem_type) for v in model.graph.input]
    outs = [(v.name, v.type.tensor_type.elem_type) for v in model.graph.output]
    return ins, outs


def check_full(model: onnx.ModelProto) -> None:
    """Full ONNX checker (includes strict shape inference)."""
    onnx.checker.check_model(model, full_check=True)
    infer(model)


# -- running ----------------------------------------------------------------------------------


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    """A CPU onnxruntime session without graph optimisations (so we run what we built)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Run `model`, casting float feeds to each input's declared type; outputs as float32."""
    sess = session(model)
    wanted = {i.name: i.type for i in (*sess.get_inputs(), *sess.get_overridable_initializers())}
    prepared = {}
    for name, array in feeds.items():
        if name not in wanted:
            continue
        target = _ORT_NUMPY.get(wanted[name])
        array = np.asarray(array)
        if target is not None and array.dtype.kind == "f":
            array = array.astype(target)
        prepared[name] = array
    return [np.asarray(o).astype(np.float32) if np.asarray(o).dtype.kind == "f" else np.asarray(o)
            for o in sess.run(None, prepared)]


def run_low(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], target: str) -> list[np.ndarray]:
    """Run a converted model: natively for float16, through FP32 emulation for bfloat16."""
    if target == "bfloat16":
        return run(emulate_low_precision(model), feeds)
    return run(model, feeds)


def assert_close(
    actual: list[np.ndarray], expected: list[np.ndarray], *, rtol: float = 1e-2, atol: float = 1e-2
) -> None:
    """Outputs agree pairwise (same count, shapes and dtypes kind, values within tolerance)."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)


def assert_matches_fp32(
    original: onnx.ModelProto,
    converted: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    *,
    target: str = "float16",
    rtol: float = 1e-2,
    atol: float = 1e-2,
) -> list[np.ndarray]:
    """The converted model's outputs match the FP32 model's on `feeds`; returns them."""
    expected = run(original, feeds)
    actual = run_low(converted, feeds, target)
    assert_close(actual, expected, rtol=rtol, atol=atol)
    return actual


def random_feeds(model: onnx.ModelProto, seed: int = 0, low: float = -1.0, high: float = 1.0) -> dict[str, np.ndarray]:
    """Uniform float32 data for every float input of `model` (static shapes only)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        if tt.elem_type in (FLOAT, FLOAT16, BFLOAT16):
            feeds[vi.name] = rng.uniform(low, high, size=shape).astype(np.float32)
    return feeds


def to_low(array: np.ndarray, target: str) -> np.ndarray:
    """Round float32 data through the 16-bit type and back."""
    return np.asarray(array, np.float32).astype(_NUMPY[LOW_TYPES[target]]).astype(np.float32)


# -- hardware ---------------------------------------------------------------------------------


def bf16_arithmetic_missing() -> str | None:
    """Why OpenVINO cannot compute bfloat16 for real on this machine, or None when it can.

    Tests that assert real bfloat16 arithmetic skip with this reason: on a CPU without
    AVX512-BF16/AMX (or with `MIXPREC_CPU_FLAGS` masking them) OpenVINO computes bfloat16
    graphs in f32."""
    from mixprec.host import host_cpu  # noqa: PLC0415
    from mixprec.runtime.openvino import openvino_available  # noqa: PLC0415

    cpu = host_cpu()
    if not cpu.computes("bfloat16"):
        return f"this CPU has {cpu.missing('bfloat16')} ({cpu.source}): OpenVINO computes bfloat16 in f32 here"
    if not openvino_available():
        return "openvino is not installed"
    import openvino  # noqa: PLC0415

    if "BF16" not in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        return "OpenVINO's CPU plugin lists no BF16 among its OPTIMIZATION_CAPABILITIES"
    return None


# The quantized MatMul model's dimensions: x [2, QDQ_K] -> [2, QDQ_N] -> y [2, QDQ_M].
QDQ_K, QDQ_N, QDQ_M = 16, 8, 4


def qdq_matmul(
    opset: int = 21, *, w_scale: float | np.ndarray | None = None, x_scale: float = 0.02, seed: int = 0
) -> onnx.ModelProto:
    """x -> Q -> DQ -> MatMul(DQ(per-channel int8 W)) -> Q -> DQ -> MatMul(float W2) -> y, and a
    float branch z = MatMul(x, W3) outside any quantized group. `w_scale`: one weight scale for
    every channel, or one per channel (default: each channel's absmax / 127)."""
    from onnx import helper as oh  # noqa: PLC0415
    from onnx import numpy_helper as nh  # noqa: PLC0415

    k, n, m = QDQ_K, QDQ_N, QDQ_M
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.5, (k, n)).astype(np.float32)
    if w_scale is None:
        ws = (np.abs(w).max(0) / 127).astype(np.float32)
    else:
        ws = np.broadcast_to(np.asarray(w_scale, np.float32), (n,)).copy()
    wq = np.clip(np.round(w / np.where(ws > 0, ws, 1)), -127, 127).astype(np.int8)
    initializers = [
        nh.from_array(np.array(x_scale, np.float32), "x_scale"),
        nh.from_array(np.array(128, np.uint8), "x_zp"),
        nh.from_array(wq, "w_q"),
        nh.from_array(ws, "w_scale"),
        nh.from_array(np.zeros(n, np.int8), "w_zp"),
        nh.from_array(np.array(0.05, np.float32), "h_scale"),
        nh.from_array(np.array(3, np.int8), "h_zp"),
        nh.from_array(rng.normal(0, 0.3, (n, m)).astype(np.float32), "w2"),
        nh.from_array(rng.normal(0, 0.3, (k, m)).astype(np.float32), "w3"),
    ]
    nodes = [
        oh.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["x_q"], name="q_x"),
        oh.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"], name="dq_x"),
        oh.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], name="dq_w", axis=1),
        oh.make_node("MatMul", ["x_dq", "w_dq"], ["h"], name="matmul_q"),
        oh.make_node("QuantizeLinear", ["h", "h_scale", "h_zp"], ["h_q"], name="q_h"),
        oh.make_node("DequantizeLinear", ["h_q", "h_scale", "h_zp"], ["h_dq"], name="dq_h"),
        oh.make_node("MatMul", ["h_dq", "w2"], ["y"], name="matmul_float"),
        oh.make_node("MatMul", ["x", "w3"], ["z"], name="matmul_other"),
    ]
    graph = oh.make_graph(
        nodes, "qdq_matmul", [oh.make_tensor_value_info("x", FLOAT, [2, k])],
        [oh.make_tensor_value_info("y", FLOAT, [2, m]), oh.make_tensor_value_info("z", FLOAT, [2, m])],
        initializers,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def matmul_chain(layers: int, seed: int) -> onnx.ModelProto:
    """x[2, 8] through `layers` MatMuls with random 8x8 weights w0, w1, ... (opset 17)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, weights, x = [], [], "x"
    for i in range(layers):
        weights.append(numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]))
        x = f"h{i}"
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, 8])], weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def relu_model(output_type: int = TensorProto.FLOAT, input_name: str = "x") -> onnx.ModelProto:
    """Relu of a [2] float input `x`; `input_name` other than "x" reads an undefined value (the
    structural checker objects), an `output_type` other than float contradicts inference (only
    the full check objects)."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", [input_name], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", output_type, [2])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def qdq_conv_group(
    initializers: list[onnx.TensorProto], x_shape: list[int], y_shape: list[int], *, bias: bool = False,
    opset: int = 21, **conv_attributes: object,
) -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv(DQ(wq)[, b]) -> Q -> DQ y, one quantized group, its scales and zero
    points among `initializers` (xs, xz, wq, ws, wz, ys, yz and b with `bias`); checked."""
    h = onnx.helper
    nodes = [
        h.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q_x"),
        h.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dq_x"),
        h.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], name="dq_w"),
        h.make_node("Conv", ["xd", "wd", "b"] if bias else ["xd", "wd"], ["c"], name="conv", **conv_attributes),
        h.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"], name="q_c"),
        h.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"], name="dq_c"),
    ]
    graph = h.make_graph(
        nodes, "qdq_conv_group", [h.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], initializers,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model
