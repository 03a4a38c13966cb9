"""The merge at the ends of float32: scales, maxima, LSEs and sums toward float32's limits.

Every finite input merges without NaN and matches the float64 reference: a weight
is taken from a difference of raw stats before the scale (a stat times a large
scale would overflow, and inf - inf is NaN), and a denominator below float32's
normal range is divided exactly (the fast reciprocal flushes it to zero). The one
limit is float32's range for a maxsum row's total sum and weighted partials. Both
stats formats and bases, the CPU twin and both GPU families (configs pinned).
"""

from __future__ import annotations

import math

import pytest
import torch

import kvsplit
from kvsplit.config import KernelConfig

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")

CONFIGS = {"cpu": [KernelConfig.kvsplit(1), KernelConfig.kvsplit(4), KernelConfig.few(2)],
           "cuda": [KernelConfig.kvsplit(1), KernelConfig.kvsplit(4),
                    KernelConfig.dsplit(1, 4, 4), KernelConfig.dsplit(2, 8, 16),
                    KernelConfig.few(1), KernelConfig.few(4)]}
NUM_SPLITS, ROWS, HEAD_DIM = 12, 16, 128
FLOAT32_MAX = torch.finfo(torch.float32).max


def pin(monkeypatch, config):
    modes = {"dsplit": f"dsplit:{config.slices}:{config.kv_split}:{config.depth}",
             "few": f"few:{config.vectors}"}
    monkeypatch.setenv("KVSPLIT_MODE", modes.get(config.family, str(config.kv_split)))


def assert_finite_and_close(out, stats, ref_out, ref_stats):
    out, stats = out.cpu().double(), stats.cpu().double()
    assert not out.isnan().any() and not stats.isnan().any()
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-6)
    expected = ref_stats.float().double()  # what float32 can hold (inf past its range)
    torch.testing.assert_close(stats, expected, rtol=1e-5, atol=1e-6)


def values(gen, n=NUM_SPLITS):
    return torch.rand(n, ROWS, HEAD_DIM, generator=gen, dtype=torch.float64) * 2 - 1


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e3, 1e30, 3e38])
@pytest.mark.parametrize("magnitude", [1.0, 1e10, 1e30, 3e38])
def test_maxsum_scales_and_maxima(device, scale, magnitude, merge_kit, monkeypatch):
    gen = merge_kit.generator("extreme-maxsum", scale, magnitude)
    m = (torch.rand(NUM_SPLITS, ROWS, generator=gen, dtype=torch.float64) * 2 - 1) * magnitude
    m = m.clamp(-FLOAT32_MAX, FLOAT32_MAX).float()
    m[0, 0] = -math.inf  # an empty split too
    l = 1 + 64 * torch.rand(NUM_SPLITS, ROWS, generator=gen)
    l[0, 0] = 0
    o = (values(gen) * l.double().unsqueeze(-1)).float()
    stats = torch.stack([m, l], -1)
    ref_out, ref_stats = merge_kit.reference("maxsum", o, stats, scale=scale)
    for config in CONFIGS[device]:
        pin(monkeypatch, config)
        out, out_stats = kvsplit.merge_maxsum(o.to(device), stats.to(device), scale,
                                              return_stats=True, out_dtype=torch.float32)
        assert_finite_and_close(out, out_stats, ref_out, ref_stats)


@pytest.mark.parametrize("base", [2.0, math.e])
@pytest.mark.parametrize("magnitude", [1.0, 1e20, 1e37, 2.4e38, 3.4e38])
def test_lse_magnitudes(device, base, magnitude, merge_kit, monkeypatch):
    gen = merge_kit.generator("extreme-lse", base, magnitude)
    lse = magnitude * (1 - 1e-3 * torch.rand(NUM_SPLITS, ROWS, generator=gen,
                                              dtype=torch.float64))
    lse[:, ::2] *= -1  # every other row at the negative end
    lse = lse.clamp(-FLOAT32_MAX, FLOAT32_MAX).float()
    o = values(gen).float()
    ref_out, ref_lse = merge_kit.reference("lse2" if base == 2.0 else "lsee", o, lse)
    for config in CONFIGS[device]:
        pin(monkeypatch, config)
        out, out_lse = kvsplit.merge_lse(o.to(device), lse.to(device), base=base,
                                         return_lse=True, out_dtype=torch.float32)
        assert_finite_and_close(out, out_lse, ref_out, ref_lse)


@pytest.mark.parametrize("sum_value", [1e-45, 1e-40, 1e-30, 1e30, 2.5e37])
def test_maxsum_sums_toward_the_limits(device, sum_value, merge_kit, monkeypatch):
    """Sums (and so unnormalised partials) of subnormal or huge size: the ratio is finite.
    (Their total, and each weighted sum of partials, must fit float32: 12 x 2.5e37 does.)"""
    gen = merge_kit.generator("extreme-sums", sum_value)
    m = torch.randn(NUM_SPLITS, ROWS, generator=gen) * 0.01
    l = torch.full((NUM_SPLITS, ROWS), sum_value)
    o = (values(gen) * sum_value).float()
    stats = torch.stack([m, l], -1)
    ref_out, ref_stats = merge_kit.reference("maxsum", o, stats, scale=1.0)
    for config in CONFIGS[device]:
        pin(monkeypatch, config)
        out, out_stats = kvsplit.merge_maxsum(o.to(device), stats.to(device), 1.0,
                                              return_stats=True, out_dtype=torch.float32)
        # Subnormal partials and their products carry few significant bits: each term of
        # the sums may be off by a few subnormal steps (2^-149) of the float32 arithmetic.
        out, out_stats = out.cpu().double(), out_stats.cpu().double()
        assert not out.isnan().any() and not out_stats.isnan().any() and out.isfinite().all()
        step = 2.0 ** -149 / float(l[0, 0]) if sum_value < 1e-37 else 0.0
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-6 + 4 * NUM_SPLITS * step)
        torch.testing.assert_close(out_stats, ref_stats.float().double(), rtol=1e-5, atol=0)


def test_scale_past_float32_is_refused():
    o, stats = torch.zeros(2, 4, 64), torch.zeros(2, 4, 2)
    with pytest.raises(ValueError, match="scale_log2"):
        kvsplit.merge_maxsum(o, stats, 4e38)
