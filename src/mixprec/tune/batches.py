"""The input batches of the search: read from paths, dicts or iterables, or generated."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mixprec.errors import InputError


def read_batches(
    data: Any, model_path: Path, max_batches: int, notes: list[str]
) -> list[dict[str, np.ndarray]]:
    """Up to `max_batches` input batches for the model at `model_path` (see `tune`'s `data`).

    None gives one generated batch, with a note added to `notes`.
    """
    from mixprec.runtime import data as data_mod  # noqa: PLC0415

    proto = onnx.load(str(model_path), load_external_data=False)
    initializers = {t.name for t in proto.graph.initializer}
    names = [v.name for v in proto.graph.input if v.name not in initializers]
    if data is None:
        notes.append("no data given: one generated batch (random inputs) is used")
        return [data_mod.generate_inputs(data_mod.input_specs(proto), seed=0)]
    if isinstance(data, (str, os.PathLike)):
        iterator: Iterable[Any] = data_mod.load_batches(data, names)
    elif isinstance(data, (list, tuple)) and data and all(isinstance(d, (str, os.PathLike)) for d in data):
        streams = [data_mod.load_batches(d, names) for d in data]  # checks every path now
        iterator = itertools.chain.from_iterable(streams)
    elif isinstance(data, Mapping):
        iterator = [data]
    elif isinstance(data, Iterable):
        iterator = data
    else:
        raise InputError(f"unsupported data {type(data).__name__}: pass a path, a batch dict or batches")
    batches = []
    for index, batch in enumerate(itertools.islice(iterator, max_batches)):
        if not isinstance(batch, Mapping):
            raise InputError(f"batch #{index} is a {type(batch).__name__}, not a dict of arrays")
        missing = [n for n in names if n not in batch]
        if missing:
            raise InputError(f"batch #{index} has no data for model input {missing[0]!r}")
        batches.append({k: np.asarray(v) for k, v in batch.items()})
    if not batches:
        raise InputError("the data holds no batches")
    return batches
