"""Bad input to an adapter: ValueError or TypeError in the engine's own names and shapes,
raised before anything is written (outputs hold a sentinel that must survive)."""

from __future__ import annotations

import pytest
import torch

from kvsplit.compat import flash_attn, flashinfer, sglang, vllm, xformers

SENTINEL = 7.0
T, H, D = 4, 8, 64


def states(device):
    g = torch.Generator().manual_seed(11)
    o = torch.randn(T, H, D, generator=g).bfloat16().to(device)
    lse = torch.randn(H, T, generator=g).to(device)  # vLLM: head-major
    return o, lse


def sentinel(*shape, dtype=torch.bfloat16, device="cpu"):
    return torch.full(shape, SENTINEL, dtype=dtype, device=device)


def cases(device):
    o, lse = states(device)
    o2, lse2 = o.clone(), lse.clone()
    v = torch.stack([o, o2], 1)          # FlashInfer merge_states [seq, N, heads, D]
    s = torch.stack([lse.t(), lse2.t()], 1)
    out = sentinel(T, H, D, device=device)
    out_lse = sentinel(H, T, dtype=torch.float32, device=device)

    def wide():  # bf16 states whose heads lie 68 elements (136 bytes) apart
        return torch.randn(T, H, D + 4, device=device).bfloat16()[..., :D]

    return {
        "vllm output_lse token-major": (
            lambda: vllm.merge_attn_states(out, o, lse, o2, lse2,
                                           sentinel(T, H, dtype=torch.float32, device=device)),
            ValueError, r"output_lse must have shape \(num_heads, num_tokens\) \(8, 4\), "
                        r"got \(4, 8\)"),
        "vllm 1-D prefix_lse": (
            lambda: vllm.merge_attn_states(out, o, lse[0], o2, lse2, out_lse),
            ValueError, r"prefix_lse must be 2-D \(num_heads, num_tokens\)"),
        "vllm suffix_output shape": (
            lambda: vllm.merge_attn_states(out, o, lse, o2[:2], lse2, out_lse),
            ValueError, r"suffix_output must have shape \(4, 8, 64\), got \(2, 8, 64\)"),
        "vllm float16 lse": (
            lambda: vllm.merge_attn_states(out, o, lse.half(), o2, lse2, out_lse),
            TypeError, r"prefix_lse must have dtype float32; got float16"),
        "vllm prefill tokens past the tokens": (
            lambda: vllm.merge_attn_states(out, o, lse, o2, lse2, out_lse, T + 1),
            ValueError, r"prefill_tokens_with_context must be 0\.\.4, got 5"),
        "vllm output_scale, bf16 output": (
            lambda: vllm.merge_attn_states(out, o, lse, o2, lse2, out_lse, None,
                                           torch.ones(1, device=device)),
            TypeError, r"output_scale is for an FP8 output"),
        "flashinfer merge_states s with a trailing dim": (
            lambda: flashinfer.merge_states(v, s[..., None]),
            ValueError, r"s must be 3-D \(seq_len, num_states, num_heads\)"),
        "flashinfer merge_states v without num_states": (
            lambda: flashinfer.merge_states(v[:, 0], s),
            ValueError, r"v must be 4-D \(seq_len, num_states, num_heads, head_dim\)"),
        "flashinfer merge_state s_b shape": (
            lambda: flashinfer.merge_state(o, lse.t(), o2, lse2),
            ValueError, r"s_b must have shape \(4, 8\), got \(8, 4\)"),
        "flashinfer merge_state_in_place mask": (
            lambda: flashinfer.merge_state_in_place(out, out_lse.t(), o2, lse2.t(),
                                                    torch.ones(T + 1, dtype=torch.bool,
                                                               device=device)),
            ValueError, r"mask must have shape \(seq_len,\) \(4,\), got \(5,\)"),
        "fa3 4-D out_partial": (
            lambda: flash_attn.flash_attn_combine(torch.randn(2, 3, 8, 64, device=device),
                                                  torch.randn(2, 3, 8, device=device)),
            ValueError, r"out_partial must be 5-D \(num_splits, batch, seqlen, num_heads, "
                        r"head_dim\)"),
        "fa3 out shape": (
            lambda: flash_attn.flash_attn_combine(torch.randn(2, 1, 3, 8, 64, device=device),
                                                  torch.randn(2, 1, 3, 8, device=device),
                                                  out=sentinel(1, 3, 8, 32, dtype=torch.float32,
                                                               device=device)),
            ValueError, r"out must have shape \(batch, seqlen, num_heads, head_dim\) "
                        r"\(1, 3, 8, 64\), got \(1, 3, 8, 32\)"),
        "vllm head_size 12": (
            lambda: vllm.merge_attn_states(out, o[..., :12], lse, o2[..., :12], lse2, out_lse),
            ValueError, r"prefix_output: head_size 12 is not supported with bfloat16 states"),
        "sglang head_size 0": (
            lambda: sglang.merge_state_v2(o[..., :0], lse.t(), o2[..., :0], lse2.t(),
                                          out[..., :0]),
            ValueError, r"v_a: head_size 0 is not supported"),
        "flashinfer merge_states head_dim 12": (
            lambda: flashinfer.merge_states(v[..., :12], s),
            ValueError, r"v: head_dim 12 is not supported"),
        "flashinfer variable_length head_dim 4": (
            lambda: flashinfer.variable_length_merge_states(
                o[..., :4], lse.t(), torch.tensor([0, 1, 4], device=device)),
            ValueError, r"v: head_dim 4 is not supported"),
        "fa3 head_dim 12": (
            lambda: flash_attn.flash_attn_combine(torch.randn(2, 1, 3, 8, 12, device=device).half(),
                                                  torch.randn(2, 1, 3, 8, device=device)),
            ValueError, r"out_partial: head_dim 12 is not supported with float16 states"),
        "fa3 float64 out": (
            lambda: flash_attn.flash_attn_combine(torch.randn(2, 1, 3, 8, 64, device=device),
                                                  torch.randn(2, 1, 3, 8, device=device),
                                                  out=torch.zeros(1, 3, 8, 64, dtype=torch.float64,
                                                                  device=device)),
            TypeError, r"^out must be torch\.float32"),
        "xformers attn_split None": (
            lambda: xformers.merge_attentions(None, torch.randn(2, 1, 8, 4, device=device)),
            TypeError, r"attn_split must be a tensor or a list of tensors, got NoneType"),
        "vllm strided suffix_output": (
            lambda: vllm.merge_attn_states(out, o, lse, torch.cat([o2, o2], -1)[..., ::2], lse2,
                                           out_lse),
            ValueError, r"suffix_output must have unit stride on head_size \(its last dim\)"),
        "flashinfer merge_state strided v_a": (
            lambda: flashinfer.merge_state(torch.cat([o, o], -1)[..., ::2], lse.t(), o2,
                                           lse2.t()),
            ValueError, r"v_a must have unit stride on head_dim \(its last dim\)"),
        "sglang 2-D states": (
            lambda: sglang.merge_state_v2(o[0], lse, o2[0], lse2, out[0]),
            ValueError, r"v_a and v_b must be 3-D \(num_tokens, num_heads, head_size\)"),
        "vllm FP8 output without output_scale": (
            lambda: vllm.merge_attn_states(
                torch.zeros(T, H, D, dtype=torch.float8_e4m3fn, device=device), o, lse, o2, lse2,
                out_lse),
            TypeError, r"output is float8_e4m3fn: an FP8 output needs output_scale"),
        "vllm sparse prefix_lse": (
            lambda: vllm.merge_attn_states(out, o, lse.to_sparse(), o2, lse2, out_lse),
            TypeError, r"prefix_lse must be a dense \(strided\) tensor, got a sparse_coo tensor"),
        "sglang sparse v_b": (
            lambda: sglang.merge_state_v2(o, lse.t(), o2.to_sparse(), lse2.t(), out),
            TypeError, r"v_b must be a dense \(strided\) tensor"),
        "flashinfer merge_states sparse v": (
            lambda: flashinfer.merge_states(v.to_sparse(), s),
            TypeError, r"v must be a dense \(strided\) tensor"),
        "flashinfer variable_length indptr past the states": (
            lambda: flashinfer.variable_length_merge_states(
                o, lse.t(), torch.tensor([0, 1, 5], device=device)),
            ValueError, r"^indptr ends at 5, past the 4 states of v$"),
        "flashinfer variable_length sparse indptr": (
            lambda: flashinfer.variable_length_merge_states(
                o, lse.t(), torch.tensor([0, 1, 4], device=device).to_sparse()),
            TypeError, r"indptr must be a dense \(strided\) tensor"),
        "xformers sparse lse_split": (
            lambda: xformers.merge_attentions(torch.stack([o, o2])[:, None],
                                              torch.stack([lse, lse2])[:, None].to_sparse()),
            TypeError, r"lse_split must be a dense \(strided\) tensor"),
        "xformers sparse chunk": (
            lambda: xformers.merge_attentions([o[None], o2[None].to_sparse()],
                                              [lse[None], lse2[None]]),
            TypeError, r"attn_split\[1\] must be a dense \(strided\) tensor"),
        "fa3 sparse out": (
            lambda: flash_attn.flash_attn_combine(torch.randn(2, 1, 3, 8, 64, device=device),
                                                  torch.randn(2, 1, 3, 8, device=device),
                                                  out=torch.zeros(1, 3, 8, 64,
                                                                  device=device).to_sparse()),
            TypeError, r"out must be a dense \(strided\) tensor"),
        "vllm prefix_output heads 136 bytes apart": (
            lambda: vllm.merge_attn_states(out, wide(), lse, wide(), lse2, out_lse),
            ValueError, r"^prefix_output: the stride of num_heads is 68 elements, 136 bytes, not "
                        r"a multiple of 16 bytes"),
        "vllm output heads 136 bytes apart": (
            lambda: vllm.merge_attn_states(wide(), o, lse, o2, lse2, out_lse),
            ValueError, r"^output: the stride of num_heads is 68 elements"),
        "sglang v_a heads 136 bytes apart": (
            lambda: sglang.merge_state_v2(wide(), lse.t(), wide(), lse2.t()),
            ValueError, r"^v_a: the stride of num_heads is 68 elements"),
        "flashinfer merge_states heads 136 bytes apart": (
            lambda: flashinfer.merge_states(
                torch.randn(T, 2, H, D + 4, device=device).bfloat16()[..., :D], s),
            ValueError, r"^v: the stride of num_heads is 68 elements"),
        "flashinfer merge_state_in_place heads 136 bytes apart": (
            lambda: flashinfer.merge_state_in_place(wide(), lse.t().contiguous(), o2,
                                                    lse2.t().contiguous()),
            ValueError, r"^v: the stride of num_heads is 68 elements"),
        "xformers K of 24 bytes": (
            lambda: xformers.merge_attentions(torch.stack([o, o2])[:, None, ..., :12],
                                              torch.stack([lse, lse2])[:, None]),
            ValueError, r"^attn_split: K 12 is not supported"),
        "xformers heads 136 bytes apart": (
            lambda: xformers.merge_attentions(
                torch.randn(2, 1, T, H, D + 4, device=device).bfloat16()[..., :D],
                torch.stack([lse, lse2])[:, None]),
            ValueError, r"^attn_split: the stride of H is 68 elements"),
        "fa3 heads 136 bytes apart": (
            lambda: flash_attn.flash_attn_combine(
                torch.randn(2, 1, T, H, D + 4, device=device).half()[..., :D],
                torch.randn(2, 1, T, H, device=device)),
            ValueError, r"^out_partial: the stride of num_heads is 68 elements"),
    }, (out, out_lse)


@pytest.mark.parametrize("case", sorted(cases("cpu")[0]))
def test_bad_input_names_the_engines_argument(device, case):
    table, outputs = cases(device)
    call, error, message = table[case]
    with pytest.raises(error, match=message):
        call()
    for output in outputs:
        assert (output.float() == SENTINEL).all(), "an output was written"
