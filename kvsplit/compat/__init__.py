"""Drop-in merges with the signatures and conventions of the engines' own.

Each adapter is one kvsplit launch with the dispatcher's config, on the
caller's tensors as they are (views, no copy), allocating only what the
original returns, except where its module says otherwise:

- :mod:`kvsplit.compat.flashinfer`: ``merge_states``, ``merge_state``,
  ``merge_state_in_place``, ``variable_length_merge_states`` (base-2 LSE);
- :mod:`kvsplit.compat.vllm`: ``merge_attn_states`` (base e, head-major LSE,
  +inf read as an empty state);
- :mod:`kvsplit.compat.sglang`: ``merge_state_v2``, ``merge_state`` (base e,
  token-major LSE, +inf read as an empty state);
- :mod:`kvsplit.compat.xformers`: ``merge_attentions`` (base e, stacked or
  listed chunks; scattered lists of more than two chunks are stacked first);
- :mod:`kvsplit.compat.flash_attn`: ``flash_attn_combine`` (FlashAttention 3's
  float32 partials);
- :mod:`kvsplit.compat.trtllm`: ``merge_chunked_attention_for_mla``
  ((max, sum) stats of normalised partials, per-request skip/merge/copy in one
  kvsplit launch).

A row whose states are all empty gives 0 and an LSE of -inf, as every kvsplit
merge does (and FlashInfer, FlashAttention 3 and xFormers); vLLM's CUDA kernel
writes the prefix's output there, SGLang's and TensorRT-LLM's give NaN.
"""
