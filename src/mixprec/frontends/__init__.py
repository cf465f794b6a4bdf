"""Framework models in: export to an `onnx_ir` model for the conversion pipeline."""
