"""The batch that flows between the driver and the workers.

A `DataProto` is three dicts that share one leading batch dimension:
`batch` holds tensors, `non_tensor` holds numpy object arrays (strings, ground
truths, uids, dicts), and `meta` holds anything that is not per-sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def _as_object_array(values) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


@dataclass
class DataProto:
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        lengths = {k: len(v) for k, v in {**self.batch, **self.non_tensor}.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"every field of a DataProto needs the same batch size, got {lengths}")

    @classmethod
    def from_dict(cls, tensors: dict | None = None, non_tensors: dict | None = None, meta: dict | None = None):
        """Build from tensors and from lists (or arrays) of arbitrary Python objects."""
        non_tensor = {k: _as_object_array(v) for k, v in (non_tensors or {}).items()}
        return cls(dict(tensors or {}), non_tensor, dict(meta or {}))

    def __len__(self) -> int:
        for value in (*self.batch.values(), *self.non_tensor.values()):
            return len(value)
        return 0

    def keys(self) -> list[str]:
        return [*self.batch, *self.non_tensor]

    def __getitem__(self, index) -> DataProto:
        """Rows by int, slice, list of ints, or boolean mask (tensor or array)."""
        if isinstance(index, int):
            index = slice(index, index + 1) if index != -1 else slice(-1, None)
        if isinstance(index, torch.Tensor):
            index = index.cpu().numpy()
        if isinstance(index, slice):
            return DataProto(
                {k: v[index] for k, v in self.batch.items()},
                {k: v[index] for k, v in self.non_tensor.items()},
                dict(self.meta),
            )
        index = np.asarray(index)
        if index.dtype == bool:
            if len(index) != len(self):
                raise ValueError(f"a boolean mask of length {len(index)} cannot index a DataProto of length {len(self)}")
            index = np.flatnonzero(index)
        positions = torch.as_tensor(index, dtype=torch.long)
        return DataProto(
            {k: v[positions.to(v.device)] for k, v in self.batch.items()},
            {k: v[index] for k, v in self.non_tensor.items()},
            dict(self.meta),
        )

    def union(self, other: DataProto) -> DataProto:
        """All fields of both; a key present in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union DataProtos of lengths {len(self)} and {len(other)}")
        for key in other.batch.keys() & self.batch.keys():
            if not torch.equal(self.batch[key], other.batch[key]):
                raise ValueError(f"union: tensor '{key}' is in both DataProtos with different values")
        for key in other.non_tensor.keys() & self.non_tensor.keys():
            if not np.array_equal(self.non_tensor[key], other.non_tensor[key]):
                raise ValueError(f"union: field '{key}' is in both DataProtos with different values")
        for key in other.meta.keys() & self.meta.keys():
            if self.meta[key] != other.meta[key]:
                raise ValueError(f"union: meta '{key}' is in both DataProtos with different values")
        return DataProto(
            {**self.batch, **other.batch},
            {**self.non_tensor, **other.non_tensor},
            {**self.meta, **other.meta},
        )

    __or__ = union

    @staticmethod
    def concat(parts: list[DataProto]) -> DataProto:
        keys = [sorted(p.keys()) for p in parts]
        if any(k != keys[0] for k in keys):
            raise ValueError(f"concat needs the same fields in every part, got {keys}")
        return DataProto(
            {k: torch.cat([p.batch[k] for p in parts]) for k in parts[0].batch},
            {k: np.concatenate([p.non_tensor[k] for p in parts]) for k in parts[0].non_tensor},
            dict(parts[0].meta),
        )

    def split(self, size: int) -> list[DataProto]:
        """Consecutive parts of `size` rows (the last may be shorter)."""
        return [self[i : i + size] for i in range(0, len(self), size)]

    def chunk(self, chunks: int) -> list[DataProto]:
        """`chunks` equal parts; the length must divide evenly (pad first if it does not)."""
        if len(self) % chunks:
            raise ValueError(f"cannot chunk a DataProto of length {len(self)} into {chunks} equal parts; pad_to_multiple({chunks}) first")
        return self.split(len(self) // chunks)

    def repeat(self, times: int, interleave: bool = True) -> DataProto:
        """Each row `times` times: a a b b (interleave) or a b a b."""
        if interleave:
            index = np.repeat(np.arange(len(self)), times)
        else:
            index = np.tile(np.arange(len(self)), times)
        return self[index]

    def select(self, *keys: str) -> DataProto:
        missing = [k for k in keys if k not in self.batch and k not in self.non_tensor]
        if missing:
            raise KeyError(f"select: no field {missing}; have {self.keys()}")
        return DataProto(
            {k: v for k, v in self.batch.items() if k in keys},
            {k: v for k, v in self.non_tensor.items() if k in keys},
            dict(self.meta),
        )

    def pop(self, *keys: str) -> DataProto:
        """Remove `keys` from this DataProto and return them as a new one."""
        popped = self.select(*keys)
        for key in keys:
            self.batch.pop(key, None)
            self.non_tensor.pop(key, None)
        return popped

    def reorder(self, indices) -> None:
        """Permute the rows in place."""
        reordered = self[indices]
        if len(reordered) != len(self):
            raise ValueError(f"reorder needs {len(self)} indices, got {len(reordered)}")
        self.batch, self.non_tensor = reordered.batch, reordered.non_tensor

    def pad_to_multiple(self, multiple: int) -> tuple[DataProto, int]:
        """Append copies of the first rows until the length divides by `multiple`."""
        pad = -len(self) % multiple
        if pad == 0:
            return self, 0
        index = np.arange(pad) % len(self)
        return DataProto.concat([self, self[index]]), pad

    def unpad(self, pad: int) -> DataProto:
        return self[: len(self) - pad] if pad else self

    def to(self, device) -> DataProto:
        return DataProto({k: v.to(device) for k, v in self.batch.items()}, self.non_tensor, self.meta)
