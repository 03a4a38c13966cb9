"""The public API's structured rows and lists of parts, and the scattered layout key."""

from __future__ import annotations

import math

import pytest
import torch

import kvsplit
from kvsplit.autotune import tuner
from kvsplit.config import build_hash
from kvsplit.dispatch import dispatcher
from kvsplit.dispatch.constraints import configs_for_key
from kvsplit.dispatch.device import device_facts
from kvsplit.dispatch.keys import scattered_stats, tuning_key
from kvsplit.reference import merge_lse_reference

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")


def _states(n, tokens, heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(n, tokens, heads, head_dim, generator=g).bfloat16()
    lse = torch.randn(n, tokens, heads, generator=g)
    return o, lse


def _reference(o, lse, base=2.0, sinks=None):
    n, tokens, heads, head_dim = o.shape
    out, ref_lse = merge_lse_reference(o.reshape(n, -1, head_dim), lse.reshape(n, -1), base=base,
                                       sinks=sinks)
    return out.view(tokens, heads, head_dim), ref_lse.view(tokens, heads)


@pytest.mark.parametrize("base", [2.0, math.e])
def test_4d_rows_with_sinks_and_any_strides(device, base):
    o, lse = _states(5, 3, 4, 128)
    sinks = torch.randn(4)
    o_view = o.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3).to(device)  # token-major
    lse_view = lse.permute(0, 2, 1).contiguous().permute(0, 2, 1).to(device)  # head-major
    out, out_lse = kvsplit.merge_lse(o_view, lse_view, base=base, sinks=sinks.to(device),
                                     return_lse=True)
    ref, ref_lse = _reference(o, lse, base, sinks)
    assert out.shape == (3, 4, 128) and out_lse.shape == (3, 4)
    assert torch.allclose(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
    assert torch.allclose(out_lse.double().cpu(), ref_lse, atol=1e-4)


@pytest.mark.parametrize("parts", [2, 3])
def test_list_of_parts(device, parts):
    o, lse = _states(parts, 2, 8, 64, seed=parts)
    o_buf, lse_buf = o.to(device), lse.to(device)
    out = kvsplit.merge_lse(list(o_buf), list(lse_buf))
    ref, _ = _reference(o, lse)
    assert torch.allclose(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_parts_not_equally_spaced():
    o, lse = _states(3, 2, 8, 64)
    # Slots 0, 1 and 3 of one buffer: 1 and 2 parts apart (three clones may land
    # equally far apart by the allocator's chance).
    buffer = torch.empty((4,) + o.shape[1:], dtype=o.dtype)
    separate = [buffer[0], buffer[1], buffer[3]]
    for part, values in zip(separate, o):
        part.copy_(values)
    with pytest.raises(ValueError, match="partial_o"):
        kvsplit.merge_lse(separate, [lse[0].clone(), lse[1].clone(), lse[2].clone()])


def test_parts_must_match():
    o, lse = _states(2, 2, 8, 64)
    with pytest.raises(ValueError, match=r"partial_o\[1\]"):
        kvsplit.merge_lse([o[0], o[1][:, :4]], [lse[0], lse[1]])


def test_out_aliasing_a_part_is_refused():
    o, lse = _states(2, 2, 8, 64)
    with pytest.raises(ValueError, match=r"^out\b.*partial_o"):
        kvsplit.merge_lse([o[0], o[1]], [lse[0], lse[1]], out=o[1])


def test_scattered_stats_classes():
    assert not scattered_stats(False, (64,), (1,))
    assert not scattered_stats(True, (64,), (2,))
    assert scattered_stats(False, (7, 32), (1, 7))  # vLLM's head-major LSE
    assert not scattered_stats(False, (1, 32), (32, 1))  # one token: adjacent after all
    assert scattered_stats(False, (2, 3, 4), (12, 1, 3))  # FlashAttention 3's LSE


def test_head_major_lse_is_its_own_key():
    o, lse = _states(2, 6, 8, 64)
    kvsplit.merge_lse(o, lse.transpose(1, 2).contiguous().transpose(1, 2))
    formats = {decision.key.stats_format for decision in dispatcher.dispatcher._decisions.values()
               if decision.key is not None}
    assert "lse:scattered" in formats


def test_the_tuner_profiles_a_scattered_key():
    facts = device_facts(torch.device("cpu"))
    key = tuning_key(facts, build_hash(False), 64, "bfloat16", "bfloat16", "lse", 8, 16,
                     scattered=True)
    assert key.stats_format == "lse:scattered"
    record = tuner.tune(key, torch.device("cpu"), configs=configs_for_key(key, is_cuda=False))
    assert record.key == key


def test_an_in_place_call_keeps_each_row_in_one_cta():
    from kvsplit.config import KernelConfig
    from kvsplit.dispatch.constraints import in_place_config
    rules = dict(head_dim=128, elem_bytes=2, rows=64, num_splits=64, sm_count=132)
    assert in_place_config(KernelConfig.dsplit(4, 8, 4), **rules) == KernelConfig.dsplit(1, 32, 4)
    assert in_place_config(KernelConfig.kvsplit(4), **rules) == KernelConfig.kvsplit(4)
