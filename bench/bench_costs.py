"""Measure the cost model's figures (`src/mixprec/policy/tables/costs.toml`) for the CPU runtimes
on this machine: memory bandwidth, matrix throughput in FP32 and in 16 bits, and the fixed cost
of one op, each run with default session options.

    python bench/bench_costs.py            # onnxruntime CPU, and OpenVINO CPU when installed
    python bench/bench_costs.py --model bench/out/llama_s.onnx --dim 128   # estimate vs measured

With `--model`, it converts the model to bfloat16 for OpenVINO and sets the report's estimated
speed against FP32 beside the speed measured on OpenVINO's CPU plugin (FP32 model with the f32
precision hint against the converted model with the bf16 hint), symbolic dimensions taken as
`--dim` (the estimate takes them as 128) and inputs generated as bench_error.py does (integers in
[0, 100)).

It prints, per runtime, flops_per_byte (16-bit matrix FLOP/s over copy bandwidth),
fp32_flop_cost (FP32 matrix time over 16-bit matrix time) and launch_bytes (the time of a
one-element op, in bytes of copy traffic). Bandwidth and the per-op time are the machine's,
measured once with onnxruntime (OpenVINO copies its outputs and fuses a chain of Adds, which
would measure neither). onnxruntime's CPU provider has no 16-bit MatMul, so its 16-bit
throughput is its FP32 one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper


def _model(nodes: list[onnx.NodeProto], inputs: list, outputs: list, opset: int = 17) -> bytes:
    graph = helper.make_graph(nodes, "bench", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model.SerializeToString()


def _copy_model(elements: int, elem_type: int = TensorProto.FLOAT) -> bytes:
    """y = x + 1 over `elements` floats (of `elem_type`): reads and writes each once."""
    one = helper.make_tensor("one", elem_type, [], [1.0])
    graph_nodes = [helper.make_node("Add", ["x", "one_c"], ["y"]), helper.make_node("Constant", [], ["one_c"], value=one)]
    return _model(
        graph_nodes[::-1],
        [helper.make_tensor_value_info("x", elem_type, [elements])],
        [helper.make_tensor_value_info("y", elem_type, [elements])],
    )


def _matmul_model(n: int) -> bytes:
    return _model(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [n, n]) for name in ("a", "b")],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])],
    )


def _chain_model(length: int) -> bytes:
    """`length` one-element Adds in a row: each costs its launch, nothing else."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Constant", [], ["one_c"], value=one)]
    previous = "x"
    for i in range(length):
        nodes.append(helper.make_node("Add", [previous, "one_c"], [f"t{i}"]))
        previous = f"t{i}"
    nodes.append(helper.make_node("Identity", [previous], ["y"]))
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )


def _median_seconds(run, feeds: dict, repeats: int) -> float:  # noqa: ANN001
    run(feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ort(model: bytes):  # noqa: ANN202
    import onnxruntime as ort  # noqa: PLC0415

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


def _openvino(model: bytes | str, precision: str):  # noqa: ANN202
    """An OpenVINO CPU runner of a serialized model (no external data) or a model file."""
    import openvino as ov  # noqa: PLC0415

    core = ov.Core()
    read = core.read_model(model, b"") if isinstance(model, bytes) else core.read_model(model)
    compiled = core.compile_model(read, "CPU", {"INFERENCE_PRECISION_HINT": precision})
    request = compiled.create_infer_request()
    return lambda feeds: request.infer(feeds)


def _check_estimate(model: str, dim: int, repeats: int) -> None:
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import mixprec  # noqa: PLC0415

    from bench_error import _inputs  # noqa: PLC0415  (the same generated inputs as the error bench)

    feeds = _inputs(model, dim, 100, 0)
    with tempfile.TemporaryDirectory() as folder:
        converted = Path(folder) / "converted.onnx"
        report = mixprec.convert(model, converted, target_dtype="bfloat16", runtime="openvino", validate="none").report
        fp32 = _median_seconds(_openvino(model, "f32"), feeds, repeats)
        low = _median_seconds(_openvino(str(converted), "bf16"), feeds, repeats)
    print(f"{model}: estimated {report.estimated_speedup:.2f}x, measured {fp32 / low:.2f}x on OpenVINO CPU "
          f"({fp32 * 1e3:.2f} ms FP32 with the f32 hint, {low * 1e3:.2f} ms converted with the bf16 hint)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 26, help="copy size in floats (default 64 Mi)")
    parser.add_argument("--n", type=int, default=2048, help="square matrix size (default 2048)")
    parser.add_argument("--chain", type=int, default=2000, help="one-element ops in the launch chain")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", action="append", default=[], help="compare the estimate with OpenVINO (repeatable)")
    parser.add_argument("--dim", type=int, default=128, help="symbolic dimensions for --model (default 128)")
    options = parser.parse_args()
    if options.model:
        for model in options.model:
            _check_estimate(model, options.dim, max(options.repeats, 20))
        return 0
    rng = np.random.default_rng(0)
    copy_feeds = {"x": rng.standard_normal(options.elements).astype(np.float32)}
    matmul_feeds = {k: rng.standard_normal((options.n, options.n)).astype(np.float32) for k in ("a", "b")}
    chain_feeds = {"x": np.ones(1, np.float32)}
    flops = 2.0 * options.n**3
    copy_bytes = 8.0 * options.elements

    runners = {"ort-cpu": {"fp32": _ort, "16": _ort}}
    try:
        import openvino  # noqa: F401, PLC0415
    except ImportError:
        print("openvino not installed: onnxruntime only")
    else:
        runners["openvino"] = {
            "fp32": lambda m: _openvino(m, "f32"),
            "16": lambda m: _openvino(m, "bf16"),
        }
    print(f"{'runtime':<9} {'copy GB/s':>9} {'fp32 GFLOP/s':>12} {'16-bit GFLOP/s':>14} {'op us':>7} "
          f"{'flops_per_byte':>14} {'fp32_flop_cost':>14} {'launch_bytes':>12}")
    copy_seconds = _median_seconds(_ort(_copy_model(options.elements)), copy_feeds, options.repeats)
    bandwidth = copy_bytes / copy_seconds
    # The same Add in float16 on onnxruntime's CPU provider: its time per element in bytes of
    # FP32 traffic (the FP32 Add moves 4 per element it reads and writes).
    half_feeds = {"x": copy_feeds["x"].astype(np.float16)}
    half_seconds = _median_seconds(_ort(_copy_model(options.elements, TensorProto.FLOAT16)), half_feeds, options.repeats)
    low_arithmetic_bytes = 4.0 * half_seconds / copy_seconds
    op_seconds = _median_seconds(_ort(_chain_model(options.chain)), chain_feeds, options.repeats) / options.chain
    for name, make in runners.items():
        fp32_rate = flops / _median_seconds(make["fp32"](_matmul_model(options.n)), matmul_feeds, options.repeats)
        low_rate = flops / _median_seconds(make["16"](_matmul_model(options.n)), matmul_feeds, options.repeats)
        print(f"{name:<9} {bandwidth / 1e9:>9.1f} {fp32_rate / 1e9:>12.1f} {low_rate / 1e9:>14.1f} "
              f"{op_seconds * 1e6:>7.2f} {low_rate / bandwidth:>14.1f} {low_rate / fp32_rate:>14.2f} "
              f"{op_seconds * bandwidth:>12.0f}")
    print(f"ort-cpu low_arithmetic_bytes {low_arithmetic_bytes:.1f} (a float16 Add takes {half_seconds / copy_seconds:.2f}x "
          "the FP32 one's time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
