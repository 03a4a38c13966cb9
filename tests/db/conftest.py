"""Fixtures for the tuning database tests.

``db_url`` (and ``store`` on top of it) runs each test against SQLite and,
when ``KVSPLIT_TEST_PG_URL`` is set (see .ci/postgres.sh), against PostgreSQL:
one database created for the session, its schema emptied before every test.
"""

from __future__ import annotations

import os
import secrets
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dbtestlib import T0  # noqa: E402
from kvsplit.db import open_store  # noqa: E402

PG_ENV = "KVSPLIT_TEST_PG_URL"


@pytest.fixture(scope="session")
def pg_session_url():
    """A database of its own on the test server, dropped at the end of the session."""
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} is not set: no PostgreSQL server (source .ci/postgres.sh to start one)")
    name = f"kvsplit_test_{os.getpid()}_{secrets.token_hex(4)}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    yield make_url(base).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def pg_url(pg_session_url):
    """The session database with an empty public schema."""
    engine = sa.create_engine(pg_session_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()
    return pg_session_url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """URL of an empty database, once per backend."""
    if request.param == "postgres":
        return request.getfixturevalue("pg_url")
    return f"sqlite:///{tmp_path / 'tuning.sqlite'}"


@pytest.fixture
def store(db_url):
    with open_store(db_url) as s:
        yield s


@pytest.fixture
def days():
    """``days(n)``: T0 plus n days, for deterministic timestamps."""
    return lambda n: T0 + timedelta(days=n)
