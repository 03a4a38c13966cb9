"""The pydantic models and the config registry: what is accepted, what is refused."""

from __future__ import annotations

import threading
import warnings
from datetime import datetime, timedelta, timezone

import pytest
from dbtestlib import H200, make_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvsplit import _native
from kvsplit.config import FAMILIES, KernelConfig
from kvsplit.export import make_export, read_export
from kvsplit.db import (
    CandidateResult,
    DeviceInfo,
    TuningKey,
    TuningPolicy,
    TuningRecord,
    open_store,
    open_store_for_library,
)
from pydantic import ValidationError


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_every_kv_split_is_a_valid_config(k):
    config = KernelConfig.kvsplit(k)
    assert config.kv_split == k and config.label == f"kvsplit(kv_split={k})"


@pytest.mark.parametrize(
    ("family", "params", "message"),
    [
        ("kvsplit", {"kv_split": 3}, "not one of 1, 2, 4, 8, 16"),
        ("kvsplit", {"kv_split": 32}, "not one of"),
        ("kvsplit", {"kv_split": 0}, "not one of"),
        ("kvsplit", {}, "missing kv_split"),
        ("kvsplit", {"kv_split": 4, "extra": 1}, "unknown extra"),
        ("headsplit", {"ctas": 2}, "unknown kernel family 'headsplit'"),
        ("kvsplit", {"kv_split": True}, "not one of"),
        ("kvsplit", {"kv_split": 4.0}, "not one of"),
    ],
)
def test_invalid_configs_are_refused(family, params, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig(family=family, params=params)
    # Inside a record validated against the kernel layer, the same problem is a validation error of that record.
    with pytest.raises(ValidationError, match=message):
        CandidateResult.model_validate({"config": {"family": family, "params": params}, "median_us": 1.0,
                                        "p10_us": 1.0, "p90_us": 1.0, "samples": 1, "matched": True},
                                       context={"config": KernelConfig})


def test_the_family_registry_is_the_kernel_layers_and_a_second_family_round_trips():
    assert FAMILIES == {family: {name: tuple(values) for name, values in params.items()}
                        for family, params in _native.ext().FAMILY_PARAMS.items()}
    other = KernelConfig(family="dsplit", params={"slices": 4, "kv_split": 16, "depth": 8})
    assert other.label == "dsplit(depth=8, kv_split=16, slices=4)"
    with pytest.raises(ValueError, match="not one of 1, 2, 4"):
        KernelConfig(family="dsplit", params={"slices": 3, "kv_split": 16, "depth": 8})
    base = make_record(winner=4)
    record = base.model_copy(
        update={
            "winner": other,
            "candidates": [
                *base.candidates,
                CandidateResult(config=other, median_us=1.0, p10_us=0.9, p90_us=1.2, samples=50, matched=True),
            ],
        }
    )
    record = TuningRecord.model_validate(record.model_dump())
    assert record.speedup == pytest.approx(8.0)
    with open_store("sqlite://") as store:
        store.upsert(record)
        assert store.get(record.key).winner == other
        assert store.load_choices(H200, "build-a") == {record.key.choice_key: other}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"median_us": -1.0}, "greater than or equal to 0"),
        ({"median_us": float("nan")}, "finite"),
        ({"p90_us": float("inf")}, "finite"),
        ({"p10_us": 9.0}, "p10_us <= median_us <= p90_us"),
        ({"samples": -1}, "greater than or equal to 0"),
        ({"samples": 0}, "0 samples failed: its times must be 0 and matched false"),
        ({"samples": 0, "median_us": 0.0, "p10_us": 0.0, "p90_us": 0.0}, "matched false"),
        ({"matched": "yes"}, "valid boolean"),
    ],
)
def test_invalid_candidates_are_refused(change, message):
    good = {"config": KernelConfig.kvsplit(2), "median_us": 5.0, "p10_us": 4.0, "p90_us": 6.0}
    good |= {"samples": 10, "matched": True}
    with pytest.raises(ValidationError, match=message):
        CandidateResult(**{**good, **change})


def test_a_failed_candidate_has_no_samples_no_times_and_did_not_match():
    failed = CandidateResult(config=KernelConfig.kvsplit(2), median_us=0.0, p10_us=0.0, p90_us=0.0,
                             samples=0, matched=False)
    assert failed.failed
    record = make_record(winner=4)
    record = record.model_copy(update={"candidates": [failed if c.config.kv_split == 2 else c
                                                      for c in record.candidates]})
    assert TuningRecord.model_validate(record.model_dump()).candidate(KernelConfig.kvsplit(2)).failed


def test_record_consistency_rules():
    record = make_record(winner=4)
    dump = record.model_dump()
    dump["candidates"][2]["matched"] = False
    with pytest.raises(ValidationError, match="did not match kv_split=1"):
        TuningRecord.model_validate(dump)
    dump = record.model_dump()
    dump["candidates"].append(dump["candidates"][0])
    with pytest.raises(ValidationError, match="appears twice"):
        TuningRecord.model_validate(dump)
    winners_only = record.model_copy(update={"candidates": []})
    assert TuningRecord.model_validate(winners_only.model_dump()).speedup is None
    with pytest.raises(ValidationError, match="l2_state"):
        TuningPolicy(l2_state="lukewarm", repeats=1, noise_margin=0.0)
    with pytest.raises(ValidationError, match="Extra inputs"):
        DeviceInfo(name="x", cc_major=9, cc_minor=0, sm_count=1, memory_gb=80)
    with pytest.raises(ValidationError, match="rows"):
        TuningKey.model_validate({**record.key.model_dump(), "rows": 2**31})


def test_timestamps_are_normalized_to_utc():
    naive = make_record(updated_at=datetime(2026, 5, 1, 12, 0))
    assert naive.updated_at == datetime(2026, 5, 1, 12, 0, tzinfo=timezone.utc)
    shifted = make_record(updated_at=datetime(2026, 5, 1, 14, 0, tzinfo=timezone(timedelta(hours=2))))
    assert shifted.updated_at == naive.updated_at and shifted.updated_at.utcoffset() == timedelta(0)


_records = st.builds(
    make_record,
    head_dim=st.sampled_from([64, 128, 256, 512]),
    partial_dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    out_dtype=st.sampled_from(["bfloat16", "float16"]),
    stats_format=st.sampled_from(["maxsum", "lse"]),
    num_splits=st.integers(1, 1024),
    rows=st.integers(1, 2_000_000),
    winner=st.sampled_from([1, 2, 4, 8, 16]),
    base_us=st.floats(0.5, 1e4, allow_nan=False),
    samples=st.integers(1, 10_000),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(_records, min_size=1, max_size=6))
def test_any_valid_records_round_trip_through_store_and_export(records):
    with open_store("sqlite://") as store, open_store("sqlite://") as other:
        store.upsert_many(records)
        latest = {r.key: r for r in records}  # later upserts of a key replace earlier ones
        assert {r.key: r.candidates for r in store.query()} == {k: r.candidates for k, r in latest.items()}
        other.import_records(read_export(make_export(store.query()).model_dump_json()))
        assert other.query() == store.query()


def test_library_memory_store_is_safe_across_threads():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = open_store_for_library("nosuchdialect://x")
    assert store.in_memory
    errors = []

    def work(t):
        try:
            for i in range(40):
                store.upsert(make_record(rows=1 + t * 100 + i))
                store.load_choices(H200, "build-a")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(store.query()) == 160
