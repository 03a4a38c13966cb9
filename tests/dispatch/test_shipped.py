"""The tuned tables shipped for the H100 and the H200 load, validate and feed the dispatcher."""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvsplit.dispatch import dispatcher as dispatch_module
from kvsplit.dispatch.constraints import constrain_config
from kvsplit.dispatch.device import DeviceFacts
from kvsplit.export import read_export

TABLES = pathlib.Path(dispatch_module.__file__).resolve().parents[1] / "tables"

H200 = DeviceFacts("NVIDIA H200", 9, 0, 132, True)
H100 = DeviceFacts("NVIDIA H100 80GB HBM3", 9, 0, 132, True)
SHIPPED_GPUS = pytest.mark.parametrize("gpu", [H100, H200], ids=["h100", "h200"])


@pytest.fixture(autouse=True)
def fresh_tables():
    dispatch_module._SHIPPED.clear()
    yield
    dispatch_module._SHIPPED.clear()


@SHIPPED_GPUS
def test_each_shipped_gpu_has_the_benchmark_grid_and_the_adapter_shapes(gpu):
    table = dispatch_module._shipped_table(gpu)
    for head_dim in (128, 512):
        for fmt in ("maxsum", "lse"):
            for dtype in ("bfloat16", "float16"):
                for num_splits in (16, 32, 64, 144, 288):  # 132 and 264 bucketed
                    for rows in (32, 64, 128, 256, 512, 2048):
                        assert (head_dim, dtype, dtype, fmt, num_splits, rows) in table
    for fmt in ("lse", "lse:scattered"):
        for rows in (16, 128, 1024):
            for num_splits in (4, 16, 64):  # 2 bucketed
                assert (128, "float32", "bfloat16", fmt, num_splits, rows) in table
                assert (576, "bfloat16", "float8_e4m3fn", fmt, num_splits, rows) in table


@SHIPPED_GPUS
def test_the_tables_serve_auto_at_the_shapes_they_were_tuned_at(gpu):
    """They were tuned with every present family, Few included: at the grid's own shapes (a key of
    N bucket 4 was profiled at 2 states) ``auto`` takes their winners without profiling."""
    grid_n = {4: 2, 144: 132, 288: 264}
    records = [r for path in sorted(TABLES.glob("*.json")) for r in read_export(path.read_text())
               if r.key.device.name == gpu.name]
    assert len(records) == 240 + 128 + 216
    assert sum(r.winner.family == "few" for r in records) > 200
    for record in records:
        key = record.key
        shape = (key.rows, grid_n.get(key.num_splits, key.num_splits))
        assert dispatch_module._untimed_families(gpu, key, shape) == set(), key.shape_label


@SHIPPED_GPUS
def test_shipped_winners_satisfy_the_constraints_at_their_key(gpu):
    table = dispatch_module._shipped_table(gpu)
    assert table
    for (head_dim, dtype, _, _, num_splits, rows), winner in table.items():
        elem = torch.finfo(getattr(torch, dtype)).bits // 8
        config = winner
        assert constrain_config(config, head_dim=head_dim, elem_bytes=elem, rows=rows,
                                num_splits=num_splits, sm_count=132) == config


def test_other_devices_get_nothing_from_the_shipped_tables():
    for other in (DeviceFacts("NVIDIA H100 PCIe", 9, 0, 114, True),
                  DeviceFacts("NVIDIA H100 80GB HBM3", 9, 0, 66, True),  # a MIG slice: fewer SMs
                  DeviceFacts("NVIDIA A100-SXM4-80GB", 8, 0, 108, True)):
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


def test_info_says_how_many_keys_ship_for_the_gpu():
    # 240 + 128 + 216 records, 12 keys of the grid and the adapters' shapes shared.
    for gpu in (H100, H200):
        assert dispatch_module.shipped_summary(gpu) == "572 keys for this GPU (kvsplit/tables)"
    assert dispatch_module.shipped_summary(DeviceFacts("NVIDIA A100-SXM4-80GB", 8, 0, 108, True)) == (
        "none for this GPU: mode auto profiles each shape at its first call")
