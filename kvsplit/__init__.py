"""kvsplit: the split-KV ("flash-decoding") attention merge, tuned per GPU and shape."""

from .merge import merge_lse, merge_maxsum

__all__ = ["merge_lse", "merge_maxsum", "__version__"]
__version__ = "0.1.0"
