"""The input batches of the search: read once (from paths, dicts or iterables) and kept, or
generated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mixprec.analysis.input_indices import fixed_input_dims, with_fixed_dims, with_index_limits
from mixprec.errors import InputError
from mixprec.runtime.batches import BatchSource
from mixprec.runtime.data import generate_inputs, input_specs


def read_batches(
    data: Any, model_path: Path, max_batches: int, notes: list[str]
) -> list[dict[str, np.ndarray]]:
    """Up to `max_batches` input batches for the model at `model_path` (see `tune`'s `data`).

    None gives the batches a conversion's check generates (the same, see
    :func:`mixprec.validate.staged.generated_batches`), with a note added to `notes`.
    """
    if data is None:
        from mixprec.validate.staged import generated_batches  # noqa: PLC0415

        batches = generated_batches(model_path)
        if batches:
            notes.append(f"no data given: {len(batches)} generated batch(es) (random inputs), as a conversion's check uses")
            return batches[:max_batches]
        notes.append("no data given: one generated batch (random inputs) is used; the FP32 model fails on it")
        # Sizes the model fixes (its weights' feature sizes, a cache's head size) where the
        # inputs name them symbolically; the others are 2.
        proto = onnx.load(str(model_path), load_external_data=False)
        specs = with_fixed_dims(with_index_limits(input_specs(proto), proto), fixed_input_dims(proto))
        return [generate_inputs(specs, seed=0)]
    proto = onnx.load(str(model_path), load_external_data=False)
    initializers = {t.name for t in proto.graph.initializer}
    names = [v.name for v in proto.graph.input if v.name not in initializers]
    source = BatchSource(data, names, max_batches)
    batches = []
    for index, batch in enumerate(source):
        missing = [n for n in names if n not in batch]
        if missing:
            raise InputError(f"batch #{index} of {source.description} has no data for model input {missing[0]!r}")
        batches.append({k: np.asarray(v) for k, v in batch.items()})
    if not batches:
        raise InputError(f"{source.description} holds no batches")
    return batches
