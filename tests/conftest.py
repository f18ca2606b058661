import pytest

from fxzero.testing import close_pools


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    """Rank pools live for the whole session (starting ranks costs seconds)."""
    yield
    close_pools()
