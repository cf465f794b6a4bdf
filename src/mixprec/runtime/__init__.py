"""Running models: onnxruntime sessions, input batches, intermediate outputs, child-process
runs and OpenVINO. Calibration, validation, NaN origin search and tune run models through here."""
