"""Input batches that can be read more than once: from files, dicts, callables or iterators."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from mixprec.errors import InputError
from mixprec.runtime.data import load_batches

Batch = Mapping[str, np.ndarray]
BatchesLike = (
    str
    | os.PathLike
    | Sequence[str | os.PathLike]
    | Mapping[str, np.ndarray]
    | Iterable[Batch]
    | Callable[[], Iterable[Batch]]
)


def _is_path(item: object) -> bool:
    return isinstance(item, (str, os.PathLike))


class BatchSource:
    """Input batches that can be iterated more than once (once per chunked run).

    Accepts a path (``.npz``, a folder of them, ONNX ``test_data_set_N``), a list of paths
    (read one after the other), one batch (a mapping), a list of batches, a callable returning
    a fresh iterable of batches, or any iterable. Paths, lists and callables are re-read on
    every pass, so batches stream from disk. A one-shot iterator (a generator) is read once:
    its batches are kept in memory for the later passes.

    Args:
        data: The batches, as above.
        input_names: The model's runtime input names in graph order (to read ONNX test data).
        max_batches: Use at most this many batches per pass (None: all).

    Raises:
        InputError: A path does not exist or holds no batches; `data` has an unsupported type.
    """

    def __init__(
        self, data: BatchesLike, input_names: Sequence[str], max_batches: int | None = None
    ) -> None:
        self.input_names = list(input_names)
        self.max_batches = max_batches
        self.description = "batches"
        self._factory: Callable[[], Iterable[Batch]]
        self._cache: list[Batch] | None = None
        self._iterator: Iterator[Batch] | None = None
        if isinstance(data, BatchSource):
            self._factory = lambda: iter(data)
            self.description = data.description
        elif _is_path(data):
            load_batches(data, self.input_names)  # checks the layout now
            self._factory = lambda: load_batches(data, self.input_names)  # type: ignore[arg-type]
            self.description = str(data)
        elif isinstance(data, Mapping):
            self._factory = lambda: [data]  # type: ignore[list-item]
            self.description = "1 batch"
        elif callable(data):
            self._factory = data  # type: ignore[assignment]
            self.description = getattr(data, "__name__", "callable")
        elif isinstance(data, Sequence) and data and all(_is_path(p) for p in data):
            paths = list(data)
            for p in paths:
                load_batches(p, self.input_names)
            self._factory = lambda: (b for p in paths for b in load_batches(p, self.input_names))
            self.description = ", ".join(str(p) for p in paths)
        elif isinstance(data, Iterable):
            if iter(data) is data:  # one-shot iterator: cache what is read
                self._iterator = iter(data)
                self._cache = []
                self.description = "iterator"
            else:
                self._factory = lambda: data  # type: ignore[return-value]
        else:
            raise InputError(
                f"unsupported input data {type(data).__name__}: pass a path, a list of paths, "
                "a batch dict, a list of batch dicts, or a callable returning batches"
            )

    def _iterate_all(self) -> Iterator[Batch]:
        if self._cache is not None:
            yield from self._replay()
            return
        produced = self._factory()
        if not isinstance(produced, Iterable):
            raise InputError(
                f"the batch callable returned {type(produced).__name__}, not an iterable"
            )
        yield from produced

    def _replay(self) -> Iterator[Batch]:
        assert self._cache is not None
        index = 0
        while True:
            if index < len(self._cache):
                yield self._cache[index]
            else:
                if self._iterator is None:
                    return
                try:
                    batch = next(self._iterator)
                except StopIteration:
                    self._iterator = None
                    return
                self._cache.append(batch)
                yield batch
            index += 1

    def __iter__(self) -> Iterator[Batch]:
        for index, batch in enumerate(self._iterate_all()):
            if self.max_batches is not None and index >= self.max_batches:
                return
            if not isinstance(batch, Mapping):
                raise InputError(
                    f"batch #{index} of {self.description} is a {type(batch).__name__}, "
                    "not a mapping of input names to arrays"
                )
            yield batch


