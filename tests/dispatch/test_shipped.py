"""The tuned table shipped for the H200 loads, validates and feeds the dispatcher."""

from __future__ import annotations

import pytest
import torch

from kvsplit.dispatch import dispatcher as dispatch_module
from kvsplit.dispatch.constraints import constrain_config
from kvsplit.dispatch.device import DeviceFacts

H200 = DeviceFacts("NVIDIA H200", 9, 0, 132, True)


@pytest.fixture(autouse=True)
def fresh_tables():
    dispatch_module._SHIPPED.clear()
    yield
    dispatch_module._SHIPPED.clear()


def test_h200_table_covers_the_benchmark_grid():
    table = dispatch_module._shipped_table(H200)
    for head_dim in (128, 512):
        for fmt in ("maxsum", "lse"):
            for dtype in ("bfloat16", "float16"):
                for num_splits in (16, 32, 64, 144, 288):  # 132 and 264 bucketed
                    for rows in (32, 64, 128, 256, 512, 2048):
                        assert (head_dim, dtype, dtype, fmt, num_splits, rows) in table


def test_h200_winners_satisfy_the_constraints_at_their_key():
    table = dispatch_module._shipped_table(H200)
    assert table
    for (head_dim, dtype, _, _, num_splits, rows), winner in table.items():
        elem = torch.finfo(getattr(torch, dtype)).bits // 8
        config = winner
        assert constrain_config(config, head_dim=head_dim, elem_bytes=elem, rows=rows,
                                num_splits=num_splits, sm_count=132) == config


def test_other_devices_get_nothing_from_the_h200_table():
    other = DeviceFacts("NVIDIA H100 80GB HBM3", 9, 0, 132, True)
    assert dispatch_module._shipped_table(other) == {}
    assert dispatch_module._shipped_table(DeviceFacts("cpu: test", 0, 0, 2, False)) == {}


def test_cached_mode_uses_the_shipped_choice(monkeypatch, tmp_path):
    """A miss in the database falls back to the shipped winner, constrained by the call."""
    monkeypatch.setenv("KVSPLIT_DB", f"sqlite:///{tmp_path / 'empty.sqlite'}")
    monkeypatch.setenv("KVSPLIT_MODE", "cached")
    table = dispatch_module._shipped_table(H200)
    key = (512, "bfloat16", "bfloat16", "maxsum", 144, 64)
    shipped = table[key]
    assert shipped.kv_split >= 4  # the cap below must bite
    fresh = dispatch_module.Dispatcher()
    config, _ = fresh.choose_config(H200, torch.device("cuda", 0), 512, torch.bfloat16,
                                    torch.bfloat16, 0, 132, 64, None)
    decision = fresh.explain(H200, 512, torch.bfloat16, torch.bfloat16, 0, 132, 64)
    assert (config, decision.source) == (shipped, "shipped")
    # A cap still applies on top of the shipped choice.
    monkeypatch.setenv("KVSPLIT_MAX_SPLIT", "2")
    capped, _ = fresh.choose_config(H200, torch.device("cuda", 0), 512, torch.bfloat16,
                                    torch.bfloat16, 0, 132, 64, None)
    assert capped == constrain_config(shipped, head_dim=512, elem_bytes=2, rows=64,
                                      num_splits=132, sm_count=132, max_split=2)
    assert capped.kv_split <= 2
    fresh.forget()
