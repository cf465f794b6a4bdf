"""Models in and out: loading with path safety (`loading`), views of a model for tools that read
whole protobufs (`views`), what ONNX's checker and inference say of a file (`onnx_file`), types
the IR cannot hold (`value_types`), atomic publishing of outputs (`publishing`), and the
protobuf written a batch of nodes at a time (`streaming`)."""

from mixprec.io.loading import load_model
from mixprec.io.onnx_file import graph_only_proto
from mixprec.io.publishing import (
    StagedModel,
    check_output_path,
    save_model,
    staged_save,
    without_staging,
    write_text_atomic,
)
from mixprec.io.views import (
    EXTERNAL_DATA_THRESHOLD,
    typed_values,
    uses_external_data,
    wants_external_data,
    weight_bytes,
    weight_free_proto,
)

__all__ = [
    "EXTERNAL_DATA_THRESHOLD", "StagedModel", "check_output_path", "graph_only_proto", "load_model", "save_model",
    "staged_save", "typed_values", "uses_external_data", "wants_external_data", "weight_bytes",
    "weight_free_proto", "without_staging", "write_text_atomic",
]
