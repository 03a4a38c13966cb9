"""Drop-in merges with the signatures and conventions of the engines' own.

Each adapter is one kvsplit launch with the dispatcher's config, on the
caller's tensors as they are (views, no copy), allocating only what the
original returns:

- :mod:`kvsplit.compat.flashinfer`: ``merge_states``, ``merge_state``,
  ``merge_state_in_place`` (base-2 LSE);
- :mod:`kvsplit.compat.vllm`: ``merge_attn_states`` (base e, head-major LSE,
  +inf read as an empty state);
- :mod:`kvsplit.compat.flash_attn`: ``flash_attn_combine`` (FlashAttention 3's
  float32 partials, 16-bit output).

Where the originals produce NaN (every state of a row empty), these give 0
and an LSE of -inf, as every kvsplit merge does.
"""
