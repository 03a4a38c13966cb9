"""Fixtures for the tuning database tests.

``store`` opens the database of ``db_url`` (tests/conftest.py): SQLite and,
when ``KVSPLIT_TEST_PG_URL`` is set (see .ci/postgres.sh), PostgreSQL; its
configs are kernel configs, as the commands and the dispatcher open it.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dbtestlib import T0  # noqa: E402
from kvsplit.config import KernelConfig  # noqa: E402
from kvsplit.db import open_store  # noqa: E402


@pytest.fixture
def store(db_url):
    with open_store(db_url, config_type=KernelConfig) as s:
        yield s


@pytest.fixture
def days():
    """``days(n)``: T0 plus n days, for deterministic timestamps."""
    return lambda n: T0 + timedelta(days=n)
