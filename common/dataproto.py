"""The batch that flows between the driver and the workers.

A `DataProto` is two dicts that share one leading batch dimension: `tensors`
and `non_tensors`, numpy object arrays (strings, ground truths, uids, dicts).
`data["advantages"]` reads or writes a field of either kind; `data[rows]`
(an int, a slice, a list of ints or a boolean mask) selects rows.
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
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        lengths = {k: len(v) for k, v in {**self.tensors, **self.non_tensors}.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"every field of a DataProto needs the same batch size, got {lengths}")

    @classmethod
    def from_dict(cls, tensors: dict | None = None, non_tensors: dict | None = None):
        """Build from tensors and from lists (or arrays) of arbitrary Python objects."""
        return cls(dict(tensors or {}), {k: _as_object_array(v) for k, v in (non_tensors or {}).items()})

    def __len__(self) -> int:
        for value in (*self.tensors.values(), *self.non_tensors.values()):
            return len(value)
        return 0

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __setitem__(self, key: str, value) -> None:
        """A field: a tensor, or a list or array of any objects, one per row."""
        if len(self) and len(value) != len(self):
            raise ValueError(f"field '{key}' has {len(value)} rows, the DataProto {len(self)}")
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = _as_object_array(value)

    def __getitem__(self, index):
        """A field by name; or rows by int, slice, list of ints, or boolean mask (tensor or array)."""
        if isinstance(index, str):
            if index in self.tensors:
                return self.tensors[index]
            if index in self.non_tensors:
                return self.non_tensors[index]
            raise KeyError(f"no field '{index}'; have {self.keys()}")
        if isinstance(index, int):
            index = slice(index, index + 1) if index != -1 else slice(-1, None)
        if isinstance(index, torch.Tensor):
            index = index.cpu().numpy()
        if isinstance(index, slice):
            return DataProto(
                {k: v[index] for k, v in self.tensors.items()}, {k: v[index] for k, v in self.non_tensors.items()}
            )
        index = np.asarray(index)
        if index.dtype == bool:
            if len(index) != len(self):
                raise ValueError(f"a boolean mask of length {len(index)} cannot index a DataProto of length {len(self)}")
            index = np.flatnonzero(index)
        positions = torch.as_tensor(index, dtype=torch.long)
        return DataProto(
            {k: v[positions.to(v.device)] for k, v in self.tensors.items()}, {k: v[index] for k, v in self.non_tensors.items()}
        )

    def union(self, other: DataProto) -> DataProto:
        """All fields of both; a key present in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union DataProtos of lengths {len(self)} and {len(other)}")
        for key in other.tensors.keys() & self.tensors.keys():
            if not torch.equal(self.tensors[key], other.tensors[key]):
                raise ValueError(f"union: tensor '{key}' is in both DataProtos with different values")
        for key in other.non_tensors.keys() & self.non_tensors.keys():
            if not np.array_equal(self.non_tensors[key], other.non_tensors[key]):
                raise ValueError(f"union: field '{key}' is in both DataProtos with different values")
        return DataProto({**self.tensors, **other.tensors}, {**self.non_tensors, **other.non_tensors})

    __or__ = union

    @staticmethod
    def concat(parts: list[DataProto]) -> DataProto:
        keys = [sorted(p.keys()) for p in parts]
        if any(k != keys[0] for k in keys):
            raise ValueError(f"concat needs the same fields in every part, got {keys}")
        return DataProto(
            {k: torch.cat([p.tensors[k] for p in parts]) for k in parts[0].tensors},
            {k: np.concatenate([p.non_tensors[k] for p in parts]) for k in parts[0].non_tensors},
        )

    def split(self, size: int) -> list[DataProto]:
        """Consecutive parts of `size` rows (the last may be shorter)."""
        return [self[i : i + size] for i in range(0, len(self), size)]

    def chunk(self, chunks: int) -> list[DataProto]:
        """`chunks` equal parts; the length must divide evenly (pad first if it does not)."""
        if len(self) % chunks:
            raise ValueError(
                f"cannot chunk a DataProto of length {len(self)} into {chunks} equal parts; pad_to_multiple({chunks}) first"
            )
        return self.split(len(self) // chunks)

    def repeat(self, times: int, interleave: bool = True) -> DataProto:
        """Each row `times` times: a a b b (interleave) or a b a b."""
        if interleave:
            index = np.repeat(np.arange(len(self)), times)
        else:
            index = np.tile(np.arange(len(self)), times)
        return self[index]

    def keep_rows(self, index) -> None:
        """In place: the rows `index` names, as `self[index]` has them (rows repeated or left out), for whoever holds
        this DataProto (an agent's session that became several samples)."""
        kept = self[index]
        self.tensors, self.non_tensors = kept.tensors, kept.non_tensors

    def select(self, *keys: str) -> DataProto:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"select: no field {missing}; have {self.keys()}")
        return DataProto(
            {k: v for k, v in self.tensors.items() if k in keys}, {k: v for k, v in self.non_tensors.items() if k in keys}
        )

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
        return DataProto({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors)
