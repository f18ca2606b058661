import pytest
import torch

import torchvision_compat
from fxzero.testing import close_pools

# before anything imports torchvision, timm or transformers (see the module's docstring)
torchvision_compat.ensure_torchvision_importable()


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    """Rank pools live for the whole session (starting ranks costs seconds)."""
    yield
    close_pools()


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: a ``job`` test is ``slow`` to ``-m "not slow"`` too
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``job`` are ``slow`` too; tests marked ``cuda`` run where a GPU is, and
    elsewhere they are skipped, saying why."""
    for item in items:
        if "job" in item.keywords:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
