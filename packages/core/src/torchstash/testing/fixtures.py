"""pytest plug-in shipped with torchstash: seeds every test and skips ``cuda`` tests without a GPU.

Load it with ``pytest_plugins = ["torchstash.testing.fixtures"]`` in a conftest.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything() -> Iterator[None]:
    torch.manual_seed(0)
    yield


@pytest.fixture(
    params=[
        pytest.param("cpu", id="cpu"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
    ]
)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Runs a test on CPU and (marked ``cuda``) on the GPU."""
    return torch.device(request.param)
