"""Command line: `mixprec convert | tune | inspect | policy | demo`.

Exit codes: 0 success; 2 bad arguments or input; 3 the converted model failed validation
(nothing written), or `tune` could not meet the tolerance (model not written, plan written);
4 the model file cannot be read; 5 the model was written but its numerics could not be checked
(the FP32 model does not run on the data or on generated inputs: pass --data).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from mixprec.config import Config
from mixprec.io import write_text_atomic
from mixprec.errors import InputError, InvariantError, MixprecError, ModelLoadError, PolicyError, ValidationFailure
from mixprec.policy.profiles import DEFAULT_RUNTIME, RUNTIMES

logger = logging.getLogger("mixprec")

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_VALIDATION = 3
EXIT_MODEL = 4
EXIT_UNCHECKED = 5


def _tolerance(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected ATOL[,RTOL], got {text!r}") from e
    if len(values) == 1:
        return values[0], values[0]
    if len(values) == 2:
        return values[0], values[1]
    raise argparse.ArgumentTypeError(f"expected ATOL[,RTOL], got {text!r}")


def _parser() -> argparse.ArgumentParser:
    # -v/--verbose goes before or after the command (`mixprec -v convert ...`, `mixprec convert
    # ... --verbose`); SUPPRESS keeps a subcommand from resetting the top-level flag (the parsers
    # share the action, so no default may be set on either).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log progress to stderr; tracebacks of unexpected errors")
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Convert FP32 ONNX models to mixed precision (float16 / bfloat16).",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", parents=[common], help="convert an FP32 model")
    convert.add_argument("input", help="FP32 .onnx model, or path/to/file.py:factory returning a PyTorch module "
                         "and its example inputs (exported with torch.onnx, then converted)")
    convert.add_argument("output", help="where to write the converted model")
    convert.add_argument("--to", default="fp16", help="fp16 (float16) or bf16 (bfloat16); default fp16")
    convert.add_argument("--exclude-node", action="append", default=[], metavar="NAME_OR_REGEX",
                         help="keep nodes whose name matches (exact or re.search) in FP32; repeatable")
    convert.add_argument("--fp32-op", action="append", default=[], metavar="OP",
                         help="keep this op type in FP32 (Op or domain::Op); repeatable")
    convert.add_argument("--low-op", action="append", default=[], metavar="OP",
                         help="always run this op type in 16 bits; repeatable")
    convert.add_argument("--follow-op", action="append", default=[], metavar="OP",
                         help="this op type follows the widest type of its inputs; repeatable")
    convert.add_argument("--io-16bit", action="store_true",
                         help="make the model's FP32 inputs and outputs 16-bit too")
    functions = convert.add_mutually_exclusive_group()
    functions.add_argument("--inline-functions", action="store_true",
                           help="inline the model's local functions first, as runtimes do when they load "
                                "it, or fail saying why not (default: inlined unless that cannot be done or "
                                "would copy more than 64 MiB of constants)")
    functions.add_argument("--keep-functions", action="store_true",
                           help="keep the model's local functions: each keeps its FP32 signature and "
                                "converts inside, behind Casts at its inputs and outputs")
    convert.add_argument("--opset", type=int, metavar="N",
                         help="upgrade the model to opset N first (default: only when the target "
                              "type needs it, e.g. 22 for bfloat16 Conv)")
    convert.add_argument("--runtime", default=None, choices=RUNTIMES,
                         help=f"the runtime the model is deployed to: nodes convert only where it "
                              f"has a 16-bit kernel (default {DEFAULT_RUNTIME}; onnx: the schema alone)")
    convert.add_argument("--weights-only", action="store_true",
                         help="store weights in 16 bits, compute in FP32 (runtimes without 16-bit "
                              "compute: half the file, FP32 speed)")
    convert.add_argument("--keep-norm-scales", action="store_true",
                         help="leave normalization scales in place (default: a scale whose output "
                              "only feeds MatMul/Gemm weights is multiplied into them, so it is "
                              "not rounded to 16 bits on its own)")
    convert.add_argument("--policy", metavar="TOML", help="use this policy table instead of the default")
    convert.add_argument("--validate", default="auto", choices=["auto", "run", "load", "checker", "none"],
                         help="auto (default): checker always; onnxruntime run for models of moderate "
                              "size, session load for larger graphs")
    convert.add_argument("--data", metavar="PATH", action="append",
                         help="input batches (.npz, a folder of .npz, or test_data_set_N; repeatable): "
                              "FP32 ranges are measured on them first, values beyond the 16-bit "
                              "range stay FP32, then the numeric check runs on them")
    convert.add_argument("--no-calibrate", action="store_true",
                         help="use --data only for the numeric check, not to measure ranges")
    convert.add_argument("--tolerance", type=_tolerance, metavar="ATOL[,RTOL]",
                         help="fail (exit 3, nothing written) when an output differs more")
    convert.add_argument("--report", metavar="JSON", help="write the report as JSON")
    convert.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    convert.add_argument("--html", metavar="HTML",
                         help="write the report as a self-contained HTML page (nodes by precision, "
                              "errors, FP32 nodes with reasons)")
    convert.add_argument("--external-data", choices=["auto", "yes", "no"], default="auto",
                         help="store weights in OUTPUT.data (auto: above 1 GiB or if the input did)")
    convert.add_argument("--plan", metavar="JSON",
                         help="apply a plan file (e.g. an edited --plan-out): its fp32 nodes stay FP32")
    convert.add_argument("--plan-out", metavar="JSON", help="write the plan used as a JSON plan file")
    convert.add_argument("--allow-invalid", action="store_true",
                         help="convert a model the ONNX checker rejects (default: refuse it, exit 4)")
    convert.add_argument("--overwrite", action="store_true",
                         help="allow OUTPUT to be the input file (replaced only once the new model is complete)")

    tune = sub.add_parser("tune", parents=[common], help="keep the fewest nodes FP32 that meet an accuracy target")
    tune.add_argument("input", help="FP32 .onnx model")
    tune.add_argument("output", help="where to write the converted model (only if the target is met)")
    tune.add_argument("--data", metavar="PATH", action="append", required=True,
                      help="input batches (.npz, a folder of .npz, or test_data_set_N; repeatable)")
    tune.add_argument("--to", default="fp16", help="fp16 (float16) or bf16 (bfloat16); default fp16")
    target = tune.add_mutually_exclusive_group(required=True)
    target.add_argument("--tolerance", type=_tolerance, metavar="ATOL[,RTOL]",
                        help="every output within allclose(atol, rtol) of the FP32 model")
    target.add_argument("--min-cosine", type=float, metavar="C",
                        help="cosine similarity of every output with the FP32 model at least C")
    target.add_argument("--topk-agreement", type=float, metavar="F",
                        help="top-1 index (last axis) agrees with the FP32 model on at least F of samples")
    tune.add_argument("--max-batches", type=int, default=4, metavar="N", help="use at most N batches (default 4)")
    tune.add_argument("--exclude-node", action="append", default=[], metavar="NAME_OR_REGEX",
                      help="keep these nodes FP32 from the start; repeatable")
    tune.add_argument("--fp32-op", action="append", default=[], metavar="OP",
                      help="keep this op type in FP32; repeatable")
    tune.add_argument("--opset", type=int, metavar="N", help="upgrade the model to opset N first")
    tune_functions = tune.add_mutually_exclusive_group()
    tune_functions.add_argument("--inline-functions", action="store_true",
                                help="inline the model's local functions first, or fail saying why not "
                                     "(default: inlined where that can be done)")
    tune_functions.add_argument("--keep-functions", action="store_true",
                                help="keep the model's local functions, each converting inside its FP32 signature")
    tune.add_argument("--runtime", default=None, choices=RUNTIMES,
                      help=f"the runtime the model is deployed to (default {DEFAULT_RUNTIME}); with "
                           "openvino installed, --runtime openvino evaluates candidates on it for real")
    tune.add_argument("--io-16bit", action="store_true", help="make the model's FP32 inputs and outputs 16-bit too")
    tune.add_argument("--plan", metavar="JSON", help="start from this plan file")
    tune.add_argument("--plan-out", metavar="JSON", help="write the plan found (also when the target is not met)")
    tune.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    tune.add_argument("--html", metavar="HTML",
                      help="write the final report with the per-node error chart as an HTML page")

    inspect = sub.add_parser("inspect", parents=[common], help="show what runs in which precision")
    inspect.add_argument("model")
    inspect.add_argument("--json", action="store_true")

    policy = sub.add_parser("policy", parents=[common], help="show the op policy for a target type")
    policy.add_argument("--to", default="fp16")
    policy.add_argument("--policy", metavar="TOML")
    policy.add_argument("--runtime", default=None, choices=RUNTIMES,
                        help=f"show the classes in effect on this runtime (default {DEFAULT_RUNTIME})")

    demo = sub.add_parser("demo", parents=[common], help="convert the built-in demo models and report")
    demo.add_argument("--out", metavar="DIR", help="keep the models in this folder")
    return parser


def _config(args: argparse.Namespace) -> Config:
    """The conversion options of `convert` and `tune` (tune has a subset of the flags)."""
    options = {
        "target_dtype": args.to,
        "exclude_nodes": args.exclude_node,
        "fp32_ops": args.fp32_op,
        "keep_io_types": not args.io_16bit,
        "opset": args.opset,
        "inline_functions": True if args.inline_functions else False if args.keep_functions else None,
        "runtime": args.runtime,
        "plan": args.plan,
    }
    if args.command == "convert":
        options.update(
            low_precision_ops=args.low_op,
            follow_ops=args.follow_op,
            policy_file=args.policy,
            validate=args.validate,
            data=args.data,
            calibrate=not args.no_calibrate,
            tolerance=args.tolerance,
            external_data={"auto": None, "yes": True, "no": False}[args.external_data],
            progress=None,
            weights_only=args.weights_only,
            fold_norm_scales=not args.keep_norm_scales,
            allow_invalid=args.allow_invalid,
            overwrite=args.overwrite,
        )
    return Config.from_options(**options)


def _cmd_convert(args: argparse.Namespace) -> int:
    from mixprec.api import convert_with_config  # noqa: PLC0415

    _check_outputs(args.input, {"OUTPUT": args.output, "--report": args.report, "--plan-out": args.plan_out, "--html": args.html})
    factory = _module_factory(args.input)
    if factory is not None:
        from mixprec.api import convert_module  # noqa: PLC0415

        module, example_inputs, dynamic_shapes = factory
        result = convert_module(module, example_inputs, args.output, dynamic_shapes=dynamic_shapes, config=_config(args))
    else:
        result = convert_with_config(args.input, args.output, _config(args))
    report = result.report
    if args.plan_out:
        from mixprec.plan.file import save_plan  # noqa: PLC0415

        save_plan(result.plan, args.plan_out)
    if args.report:
        write_text_atomic(args.report, report.to_json())
    if args.html:
        from mixprec.report import write_html_report  # noqa: PLC0415

        write_html_report(report, args.html)
    if args.json:
        print(report.to_json())
    else:
        print(report.format_text())
    if report.validation.numerics_unchecked:
        print(f"mixprec: warning: {args.output} written, numerics {report.validation.numerics}", file=sys.stderr)
        return EXIT_UNCHECKED
    return EXIT_OK


def _cmd_tune(args: argparse.Namespace) -> int:
    from mixprec.tolerance import Tolerance  # noqa: PLC0415
    from mixprec.tune import tune  # noqa: PLC0415

    if args.tolerance is not None:
        tolerance = Tolerance(atol=args.tolerance[0], rtol=args.tolerance[1])
    elif args.min_cosine is not None:
        tolerance = Tolerance(min_cosine=args.min_cosine)
    else:
        tolerance = Tolerance(topk_agreement=args.topk_agreement)
    result = tune(
        args.input,
        args.data if len(args.data) > 1 else args.data[0],
        config=_config(args),
        tolerance=tolerance,
        max_batches=args.max_batches,
        progress=sys.stderr.isatty() or args.verbose,
        output=args.output,
    )
    if args.plan_out:
        result.save_plan(args.plan_out)
    if args.html and result.report is not None:
        from mixprec.report import write_html_report  # noqa: PLC0415

        write_html_report(result.report, args.html, per_node_errors=list(result.contributions))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(result.format_text())
    if not result.met:
        print(
            f"mixprec: error: tolerance not met even with all {result.candidates} candidate node(s) "
            f"FP32 ({result.evaluations} evaluation(s)); {args.output} not written"
            + (f", plan written to {args.plan_out}" if args.plan_out else ""),
            file=sys.stderr,
        )
        return EXIT_VALIDATION
    return EXIT_OK


def _module_factory(source: str) -> tuple[object, object, object] | None:
    """For `path/to/file.py:factory`: the PyTorch module, example inputs and dynamic shapes the
    factory returns (`(module, example_inputs)` or `(module, example_inputs, dynamic_shapes)`);
    None for a model file."""
    match = re.fullmatch(r"(.+\.py):([A-Za-z_][A-Za-z0-9_]*)", source)
    if match is None:
        return None
    import importlib.util  # noqa: PLC0415

    path, name = Path(match[1]), match[2]
    if not path.is_file():
        raise InputError(f"{path}: no such Python file (expected path/to/file.py:factory)")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise InputError(f"{path}: cannot be imported as a Python module")
    code = importlib.util.module_from_spec(spec)
    # Imported as a script of its folder would be: registered, its siblings importable.
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    sys.modules.setdefault(spec.name, code)
    try:
        spec.loader.exec_module(code)
        factory = getattr(code, name, None)
        if not callable(factory):
            raise InputError(f"{path} defines no function {name!r}")
        made = factory()
    except MixprecError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: its error in one line
        raise InputError(f"{source}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise InputError(f"{source} must return (module, example_inputs) or (module, example_inputs, dynamic_shapes)")
    return (made[0], made[1], made[2] if len(made) == 3 else None)


def _check_outputs(source: str, outputs: dict[str, str | None]) -> None:
    """Every file the command will write is writable and distinct, before any work."""
    from mixprec.io import check_output_path  # noqa: PLC0415

    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if not path:
            continue
        check_output_path(path)
        resolved = os.path.realpath(path)
        if resolved in seen:
            raise InputError(f"{flag} and {seen[resolved]} name the same file {path}")
        if flag != "OUTPUT" and resolved == os.path.realpath(source):
            raise InputError(f"{flag} {path} is the input model")
        seen[resolved] = flag


def _cmd_inspect(args: argparse.Namespace) -> int:
    from mixprec.inspection import summarize_model  # noqa: PLC0415

    summary = summarize_model(args.model)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.format_text())
    return EXIT_OK


def _cmd_policy(args: argparse.Namespace) -> int:
    from mixprec.dtypes import parse_low_precision  # noqa: PLC0415
    from mixprec.policy.table import load_policy  # noqa: PLC0415

    from mixprec.policy.profiles import effective_classes, load_runtime  # noqa: PLC0415

    policy = load_policy(parse_low_precision(args.to), args.policy)
    runtime = load_runtime(args.runtime)
    print(
        f"policy for {policy.target.value} on runtime {runtime.name} ({runtime.description}); "
        "ops in no class keep their original types"
    )
    classes = effective_classes(policy, runtime)
    for op_class, rows in classes.items():
        print(f"\n{op_class} ({len(rows)}):")
        for op, reason in rows:
            print(f"  {op:<44} {reason}")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    import onnx  # noqa: PLC0415

    from mixprec.api import convert  # noqa: PLC0415
    from mixprec.demo_models import DEMO_MODELS  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="mixprec-demo-") as tmp:
        folder = Path(args.out) if args.out else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name, build in DEMO_MODELS.items():
            source = folder / f"{name}.onnx"
            onnx.save(build(), str(source))
            # float16 for onnxruntime CUDA (the default runtime); bfloat16 for OpenVINO, which
            # runs it for real on CPUs with AVX512-BF16/AMX (checked there when installed).
            # bfloat16 Conv and pooling need opset 22: the CNN is upgraded on the way.
            for target, runtime in (("fp16", None), ("bf16", "openvino")):
                output = folder / f"{name}.{target}.onnx"
                result = convert(source, output, target_dtype=target, validate="run", runtime=runtime)
                print(result.report.format_text())
                print()
        if args.out:
            print(f"models written to {folder}")
    return EXIT_OK


# The subcommands, by name.
_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "convert": _cmd_convert,
    "inspect": _cmd_inspect,
    "policy": _cmd_policy,
    "demo": _cmd_demo,
    "tune": _cmd_tune,
}

# Expected errors, first match wins: (types, what follows the message, exit code).
_ERROR_EXITS: tuple[tuple[type[Exception] | tuple[type[Exception], ...], str, int], ...] = (
    (ModelLoadError, "", EXIT_MODEL),
    (ValidationFailure, " (nothing written)", EXIT_VALIDATION),
    # A conversion step broke the model: a bug, exit as for other unexpected errors.
    (InvariantError, " (nothing written)", EXIT_MODEL),
    ((InputError, PolicyError, MixprecError), "", EXIT_USAGE),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mixprec` command."""
    args = _parser().parse_args(argv)
    if argv is None and args.command == "convert":
        # Run as the command: one conversion, then the process ends. Cyclic garbage is left to
        # the end, so no collection walks the converted model (seconds for 100k nodes).
        gc.disable()
    args.verbose = getattr(args, "verbose", False)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        return _COMMANDS[args.command](args)
    except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - the boundary: one line each
        return _report_error(e, args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if argv is None:
            # Run as the command: the process ends now. Without this, the interpreter's last
            # collection walks every object of the converted model (seconds for 100k nodes).
            gc.freeze()


def _report_error(e: BaseException, args: argparse.Namespace) -> int:
    """Say on stderr, in one line, why the command `args` stopped with `e`; return the exit
    code. Call it while handling `e` (with --verbose, unexpected errors print its traceback)."""
    for kinds, suffix, code in _ERROR_EXITS:
        if isinstance(e, kinds):
            print(f"mixprec: error: {e}{suffix}", file=sys.stderr)
            return code
    if isinstance(e, KeyboardInterrupt):
        print("mixprec: interrupted", file=sys.stderr)
        return 130
    if isinstance(e, OSError):  # a full or read-only disk, a vanished file, ...
        where = f"{e.filename}: " if e.filename else ""
        print(f"mixprec: error: {where}{e.strerror or e} (nothing written)", file=sys.stderr)
        return EXIT_USAGE
    return _report_unexpected(e, args)


def _report_unexpected(e: BaseException, args: argparse.Namespace) -> int:
    """The boundary for errors of no expected kind: one line naming the model and the root
    cause (wrappers repeat whole protobufs; the cause says why), the traceback with --verbose;
    exit as for a model that cannot be processed."""
    if args.verbose:
        traceback.print_exc()
    subject = getattr(args, "input", None) or getattr(args, "model", None) or args.command
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    first = (str(root).strip().splitlines() or [""])[0][:300]
    print(
        f"mixprec: error: cannot process {subject}: {type(root).__name__}: {first} "
        "(an unsupported model or a bug; --verbose shows where)",
        file=sys.stderr,
    )
    return EXIT_MODEL


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so staging folders and temporary files are removed."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
