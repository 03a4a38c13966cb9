"""The kernel config and the kernel layer's vocabulary, as the compiled module exports it.

Every code (dtypes, stats formats, families), every legal parameter value and
every family rule comes from ``kvsplit._ext``, which reads them off
``csrc/include/kvsplit/config.h``; nothing here restates them. Importable
without torch (the commands use it); the store below never imports it.

:class:`KernelConfig` is the one config type of the project: the dispatcher
chooses one, the tuner measures them, the database stores them (as
``{"family": ..., "params": {...}}``) and the launcher turns one into the
C++ ``KernelConfig`` of the same fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import _native
from .db.schemas import BASELINE as _BASELINE
from .db.schemas import BASELINE_FAMILY, Config

_ext = _native.ext()

#: The largest head dim; a head dim is legal when a row is whole 16-byte vectors
#: of the partial dtype (:func:`head_dim_supported`), from 16 bytes up to this.
MAX_HEAD_DIM: int = _ext.MAX_HEAD_DIM
#: Head-dim elements per scale of per-group FP8 outputs.
QUANT_GROUPS: tuple[int, ...] = tuple(_ext.QUANT_GROUPS)
#: dtype name (torch's, without ``torch.``) -> the kernel layer's code.
DTYPE_CODES: dict[str, int] = dict(_ext.DTYPES)
#: dtype name -> bytes per element.
DTYPE_BYTES: dict[str, int] = dict(_ext.DTYPE_BYTES)
#: stats format name -> code.
STATS_FORMAT_CODES: dict[str, int] = dict(_ext.STATS_FORMATS)
#: stats format code -> name.
STATS_FORMAT_NAMES: dict[int, str] = {code: name for name, code in STATS_FORMAT_CODES.items()}
#: family name -> code.
FAMILY_CODES: dict[str, int] = dict(_ext.FAMILIES)


def _exported(name: str, names) -> str:
    """``name``, which Python code treats apart, if the compiled module exports it."""
    if name not in names:
        raise ImportError(f"kvsplit's compiled module has no {name!r} (it has {', '.join(names)}): "
                          "it is another build than this Python package's; reinstall kvsplit")
    return name


#: The families and stats formats that code treats one by one, by their exported names.
KVSPLIT, DSPLIT, FEW = (_exported(name, FAMILY_CODES) for name in ("kvsplit", "dsplit", "few"))
MAXSUM_FORMAT, LSE_FORMAT = (_exported(name, STATS_FORMAT_CODES) for name in ("maxsum", "lse"))
#: family name -> {parameter name -> legal values}.
FAMILIES: dict[str, dict[str, tuple[int, ...]]] = {
    family: {name: tuple(values) for name, values in params.items()}
    for family, params in _ext.FAMILY_PARAMS.items()}
#: Values of the C++ config fields that a family does not take as parameters.
CONFIG_DEFAULTS: dict[str, int] = dict(_ext.CONFIG_DEFAULTS)
#: The kernel layer's geometry constants (threads per CTA, lane limits, ...).
LIMITS: dict[str, int] = dict(_ext.LIMITS)
#: error code of :func:`check` -> the name of the broken rule.
ERRORS: dict[int, str] = dict(_ext.ERRORS)
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
#: (partial dtype name, output dtype name) pairs the kernels take.
DTYPE_PAIRS: tuple[tuple[str, str], ...] = tuple(
    (_DTYPE_NAMES[a], _DTYPE_NAMES[b]) for a, b in _ext.DTYPE_PAIRS)
#: Partial dtypes, and output dtypes (of any partial dtype), by name.
PARTIAL_DTYPES: tuple[str, ...] = tuple(dict.fromkeys(a for a, _ in DTYPE_PAIRS))
OUT_DTYPES: tuple[str, ...] = tuple(dict.fromkeys(b for _, b in DTYPE_PAIRS))
#: Output dtypes that take an FP8 scale.
FP8_DTYPES: tuple[str, ...] = tuple(d for d in OUT_DTYPES if d.startswith("float8"))
#: partial dtype name -> the output dtype of a call that names none: the partials' own,
#: bfloat16 for float32 partials (a choice of the Python API, among the kernels' pairs).
DEFAULT_OUT_DTYPES: dict[str, str] = {
    partial: partial if partial != "float32" else "bfloat16" for partial in PARTIAL_DTYPES}
assert all(pair in DTYPE_PAIRS for pair in DEFAULT_OUT_DTYPES.items())


#: partial dtype name -> the head dims the kernels take (the kernel layer's rule, asked once
#: per value so that validation is plain Python that torch.compile traces).
HEAD_DIMS: dict[str, frozenset[int]] = {
    name: frozenset(d for d in range(1, MAX_HEAD_DIM + 1)
                    if _ext.head_dim_supported(d, DTYPE_BYTES[name]))
    for name in PARTIAL_DTYPES}


def head_dim_supported(head_dim: int, partial_dtype: str) -> bool:
    """Whether the kernels take rows of ``head_dim`` elements of ``partial_dtype``: whole
    16-byte vectors, from 16 bytes up to :data:`MAX_HEAD_DIM` elements."""
    return head_dim in HEAD_DIMS[partial_dtype]


def head_dim_rule(partial_dtype: str) -> str:
    """The head-dim rule for ``partial_dtype``, as error messages state it."""
    step = 16 // DTYPE_BYTES[partial_dtype]
    return f"a multiple of {step} (16 bytes of {partial_dtype}) from {step} to {MAX_HEAD_DIM}"

#: A tuning key's stats format is the kernel's format, or it with this suffix
#: for the layout class whose stats of adjacent rows are apart (dispatch/keys.py).
SCATTERED = ":scattered"
#: Every stats format a tuning key can hold: each kernel format, and it with SCATTERED.
KEY_STATS_FORMATS: tuple[str, ...] = (tuple(STATS_FORMAT_CODES)
                                      + tuple(name + SCATTERED for name in STATS_FORMAT_CODES))


def split_stats_format(field: str) -> tuple[str, bool]:
    """A key's stats format field -> (kernel format name, scattered): ``"lse:scattered"``
    -> ``("lse", True)``."""
    base, _, layout = field.partition(":")
    return base, bool(layout)


BASELINE_PARAMS: dict[str, int] = dict(_BASELINE.params)


def build_hash(is_cuda: bool) -> str:
    """The hash that keys stored tunings: of the CUDA kernels, or of the CPU implementation."""
    if is_cuda:  # a build without CUDA kernels still names GPU keys (they can never match)
        return _ext.cuda_build_hash or "no-cuda-kernels"
    return _ext.cpu_build_hash


def has_cuda_kernels() -> bool:
    """Whether this build contains the CUDA kernels."""
    return bool(_ext.cuda_build_hash)


#: What a merge of CUDA tensors raises on a build without CUDA kernels: the cause and the
#: remedy ("" on a build with them).
NO_CUDA_KERNELS: str = _ext.no_cuda_kernels


def check_params(family: str, params: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the problem unless ``params`` are exactly ``family``'s, each legal."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r} (known: {', '.join(sorted(FAMILIES))})")
    allowed = FAMILIES[family]
    missing = sorted(set(allowed) - set(params))
    unknown = sorted(set(params) - set(allowed))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown {', '.join(unknown)}")
        raise ValueError(f"family {family!r} takes parameters {sorted(allowed)}: {'; '.join(parts)}")
    for name, value in params.items():
        # bool is an int subclass; True as a K would be a silent K=1.
        if isinstance(value, bool) or not isinstance(value, int) or value not in allowed[name]:
            raise ValueError(f"{family}.{name}={value!r} is not one of {', '.join(map(str, allowed[name]))}")


class KernelConfig(Config):
    """What the kernel runs: a family and its integer parameters, e.g. ``kvsplit(kv_split=4)``.

    The store's plain :class:`~kvsplit.db.schemas.Config`, checked against the
    kernel layer's vocabulary.  Immutable and hashable. ``slices``,
    ``kv_split``, ``depth`` and ``vectors`` are the fields of the C++ config (a
    family's missing parameters take :data:`CONFIG_DEFAULTS`); ``params`` is
    what the database stores.  Validating a store model with
    ``context={"config": KernelConfig}`` checks its configs this way.
    """

    __slots__ = ("slices", "kv_split", "depth", "vectors", "family_code")

    def __init__(self, family: str = BASELINE_FAMILY, params: Mapping[str, int] | None = None):
        params = {} if params is None else params
        if not isinstance(params, Mapping):
            raise ValueError(f"params must be a mapping of parameter names to ints, got {params!r}")
        check_params(family, params)
        super().__init__(family, params)
        fields = {**CONFIG_DEFAULTS, **params}
        set_ = object.__setattr__
        set_(self, "family_code", FAMILY_CODES[family])
        set_(self, "slices", fields["slices"])
        set_(self, "kv_split", fields["kv_split"])
        set_(self, "depth", fields["depth"])
        set_(self, "vectors", fields["vectors"])

    @classmethod
    def kvsplit(cls, kv_split: int) -> KernelConfig:
        """The KvSplit family config with ``kv_split`` thread groups per row."""
        return cls(KVSPLIT, {"kv_split": kv_split})

    @classmethod
    def dsplit(cls, slices: int, kv_split: int, depth: int = 4) -> KernelConfig:
        """The DSplit family config: ``slices`` CTAs per row, ``kv_split`` groups, ``depth`` per round."""
        return cls(DSPLIT, {"depth": depth, "kv_split": kv_split, "slices": slices})

    @classmethod
    def few(cls, vectors: int = 1) -> KernelConfig:
        """The Few family config: ``vectors`` 16-byte vectors of a row per thread, each
        thread merging every state of them (its rounds' depth: :func:`few_depth`)."""
        return cls(FEW, {"vectors": vectors})

    def native(self):
        """The C++ ``KernelConfig`` of the binding."""
        return _ext.KernelConfig(self.family_code, self.slices, self.kv_split, self.depth,
                                 self.vectors)


BASELINE = KernelConfig(_BASELINE.family, _BASELINE.params)


def check(config: KernelConfig, head_dim: int, elem_bytes: int) -> str | None:
    """The name of the kernel-layer rule that ``config`` breaks on rows of ``head_dim``
    partials of ``elem_bytes`` bytes, or None."""
    error = _ext.check_config(config.family_code, config.slices, config.kv_split, config.depth,
                              config.vectors, head_dim, elem_bytes)
    return ERRORS[error] if error else None


def check_call(config: KernelConfig, head_dim: int, elem_bytes: int, *, stats_in_place: bool,
               quant_group: int = 0) -> str | None:
    """The name of the rule that a call's in-place stats export or per-group FP8 scales of
    ``quant_group`` elements (0: none) add and ``config`` breaks, or None."""
    error = _ext.check_call_rules(config.family_code, config.slices, config.kv_split,
                                  config.depth, config.vectors, head_dim, elem_bytes,
                                  stats_in_place, quant_group)
    return ERRORS[error] if error else None


def kvsplit_rows_per_band(head_dim: int, elem_bytes: int, kv_split: int) -> int:
    """Rows one KvSplit CTA covers per band of rows (0: a group cannot hold a row)."""
    return _ext.kvsplit_rows_per_band(head_dim, elem_bytes, kv_split)


def dsplit_slice_elems(head_dim: int, elem_bytes: int, slices: int) -> int:
    """Elements of a DSplit slice of a row (the last may be shorter; 0: not legal)."""
    return _ext.dsplit_slice_vectors(head_dim, elem_bytes, slices) * 16 // elem_bytes


def few_threads_per_row(head_dim: int, elem_bytes: int, vectors: int) -> int:
    """Threads per row of a Few config of ``vectors`` vectors a thread (0: not legal)."""
    return _ext.few_threads_per_row(head_dim, elem_bytes, vectors)


def few_depth(num_splits: int, vectors: int) -> int:
    """States a Few thread of ``vectors`` vectors loads per round in a call of
    ``num_splits`` states (the call's order of combination)."""
    return _ext.few_depth(num_splits, vectors)


def few_launch(lanes: int, rows: int, sm_count: int) -> tuple[int, int, int]:
    """(threads per CTA, CTAs, rows per pass of the grid) of a Few launch of ``rows`` rows
    of ``lanes`` threads on ``sm_count`` SMs."""
    return tuple(_ext.few_launch(lanes, rows, sm_count))


def legal_configs(head_dim: int, elem_bytes: int, families: tuple[str, ...] = tuple(FAMILIES)):
    """Every config of ``families`` that the kernel layer can run at ``head_dim``/``elem_bytes``."""
    configs = []
    for family in families:
        names = [name for name in CONFIG_DEFAULTS if name in FAMILIES[family]]  # field order
        grids: list[dict[str, int]] = [{}]
        for name in names:
            grids = [{**g, name: v} for g in grids for v in FAMILIES[family][name]]
        for params in grids:
            config = KernelConfig(family, params)
            if check(config, head_dim, elem_bytes) is None:
                configs.append(config)
    return configs
