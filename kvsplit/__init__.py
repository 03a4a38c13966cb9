"""kvsplit: the split-KV ("flash-decoding") attention merge, tuned per GPU and shape.

``merge_maxsum`` and ``merge_lse`` are loaded on first use, so that
``kvsplit.db`` and the database commands start without importing torch.
"""

__all__ = ["merge_lse", "merge_maxsum", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("merge_lse", "merge_maxsum"):
        from . import merge

        value = globals()[name] = getattr(merge, name)  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'kvsplit' has no attribute {name!r}")
