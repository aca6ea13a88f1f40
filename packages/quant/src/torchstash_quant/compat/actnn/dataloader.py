"""ActNN's ``DataLoader``: a torch DataLoader whose batches come with their samples' indices,
``for indices, (images, target) in loader``, for ``QScheme.batch = indices``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate


class _Indexed(Dataset):
    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]


class DataLoader(torch.utils.data.DataLoader):
    def __init__(
        self, dataset: Any, *args: Any, collate_fn: Callable[[Any], Any] | None = None, **kw: Any
    ) -> None:
        collate = collate_fn or default_collate

        def with_indices(items: list[tuple[int, Any]]) -> tuple[torch.Tensor, Any]:
            return torch.tensor([i for i, _ in items]), collate([item for _, item in items])

        super().__init__(_Indexed(dataset), *args, collate_fn=with_indices, **kw)
