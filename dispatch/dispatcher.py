"""Per-call choice of the kernel config (a family and its parameters): cached choice ->
constraints.

After the first call of a shape, :meth:`Dispatcher.choose_config` is one dictionary
lookup (no SQL, no device sync, no allocation). The slow path, taken once per
shape, decides in this order:

1. a ``kv_split`` forced by the caller (KvSplit family);
2. ``KVSPLIT_MODE``: ``off`` (KvSplit K = 1), a fixed KvSplit K (``8``), a
   fixed DSplit config (``dsplit:SLICES:KV_SPLIT[:DEPTH]``, e.g. ``dsplit:4:16:8``)
   or a fixed Few config (``few:VECTORS``, e.g. ``few:2``);
   ``auto`` (default) and ``cached`` go on;
3. the tuning database (``KVSPLIT_DB``), loaded whole for this device and
   kernel build on first use (the store, and the tuner, are imported then:
   ``import kvsplit`` loads neither);
4. the tables shipped with the package for this device (in ``auto``, only a
   record that timed every family the present tuner would time for its key:
   a table made before a family existed does not keep that family from it;
   such a record's winner serves a capture in place of the heuristic);
5. ``auto``: profile the key now (never during CUDA-graph capture: then the
   heuristic serves, nothing is cached and the key is recorded as pending; nor
   where the profile's scratch would take more than PROFILE_MEMORY_SHARE of the
   device's free memory: then the heuristic serves and the key is pending);
   ``cached``: the heuristic.

A choice is a :class:`~kvsplit.config.KernelConfig` of any family. Whatever
the source, :func:`constrain_config` has the last word, so a tampered table
can only cost speed. :func:`config_for_layout` is what a call layout's launch
(:class:`kvsplit.launches.LayoutLaunch`) asks. The eager merges keep their
per-layout launches in the launch table, :attr:`Dispatcher.launches`, which
:meth:`Dispatcher.refresh` and :meth:`Dispatcher.forget` clear when choices
change.

Winners that other processes store later (a fleet tuning while this one
serves) are picked up by :meth:`Dispatcher.refresh`: on a miss, and every
``KVSPLIT_REFRESH_S`` seconds (see :mod:`.refresh`).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from importlib import resources

import torch

from ..config import DSPLIT, FEW, MAXSUM_FORMAT, STATS_FORMAT_CODES, KernelConfig, build_hash
from ..launches import ConfigRequest, LaunchTable
from ..launches import table as launch_table
from .refresh import Refresher, refresh_interval
from .constraints import (DSPLIT_DEPTHS, DSPLIT_KV_SPLITS, DSPLIT_SLICES, FEW_VECTORS,
                          KV_SPLITS, configs_for_key, constrain_config, few_only_config,
                          group_quant_config, in_place_config, kvsplit_config)
from .device import DeviceFacts, device_facts
from .keys import STATS_FORMATS, device_info, dtype_name, scattered_stats, tuning_key
from . import InvalidSetting

__all__ = ["KV_SPLITS", "MODES", "Decision", "Dispatcher", "choose_config", "config_for_layout",
           "dispatcher", "pdl_enabled", "read_environment"]

log = logging.getLogger("kvsplit.dispatch")
MAXSUM = STATS_FORMAT_CODES[MAXSUM_FORMAT]
_LIBRARY_DB_TIMEOUT_S = 5.0
#: Decisions that come from a table of winners: a refresh that changes their key drops them.
_TABLE_SOURCES = ("database", "shipped", "heuristic", "tuned")
#: A first-use profile runs only where its scratch takes at most this share of the memory
#: free on its device (the call's own tensors need the rest); a larger key is served by the
#: heuristic and left pending for `kvsplit tune --pending`.
PROFILE_MEMORY_SHARE = 0.5
MODES = ("auto", "cached", "off") + tuple(str(k) for k in KV_SPLITS) + (
    "dsplit:SLICES:KV_SPLIT[:DEPTH]", "few:VECTORS")


def free_memory(facts: DeviceFacts, device: torch.device) -> int | None:
    """Bytes free for a first-use profile on ``device``: the GPU's free memory and what
    torch's caching allocator holds unused; on the CPU the kernel's MemAvailable; None
    where unknown."""
    try:
        if facts.is_cuda:
            free, _ = torch.cuda.mem_get_info(device)
            return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError, IndexError):
        return None
    return None


def _fixed_config(mode: str) -> KernelConfig | None:
    """The config a fixed ``KVSPLIT_MODE`` names (``8``, ``dsplit:4:16:8``, ``few:2``),
    else None."""
    if mode.isdigit() and int(mode) in KV_SPLITS:
        return kvsplit_config(int(mode))
    family, *numbers = mode.split(":")
    arities = {DSPLIT: (2, 3), FEW: (1,)}
    if family in arities and len(numbers) in arities[family] and all(n.isdigit() for n in numbers):
        try:
            return getattr(KernelConfig, family)(*map(int, numbers))
        except ValueError:
            return None
    return None


def _env_int(name: str, raw: str | None) -> int | None:
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:  # 0 or -1 would silently mean K = 1 (or no cap)
        raise InvalidSetting(f"{name} must be a positive integer (an upper bound on K), got {raw!r}")
    return value


def read_settings(mode: str | None, max_split: str | None) -> tuple[str, KernelConfig | None, int | None]:
    """``(mode, its fixed config or None, cap on K)`` from raw ``KVSPLIT_MODE`` and ``KVSPLIT_MAX_SPLIT``.

    Raises :class:`~kvsplit.dispatch.InvalidSetting` (a ``ValueError``) naming
    the variable when either is unusable.
    """
    mode = mode or "auto"
    fixed = _fixed_config(mode)
    if fixed is None and mode not in ("auto", "cached", "off"):
        raise InvalidSetting(f"KVSPLIT_MODE must be one of {', '.join(MODES)} (dsplit: SLICES "
                             f"in {DSPLIT_SLICES}, KV_SPLIT in {DSPLIT_KV_SPLITS}, DEPTH in "
                             f"{DSPLIT_DEPTHS}; few: VECTORS in {FEW_VECTORS}); got {mode!r}")
    return mode, fixed, _env_int("KVSPLIT_MAX_SPLIT", max_split)


def _environment_reader():
    """A fast reader of the four variables that key the per-call cache.

    ``os.environ.get`` raises and catches a KeyError for every unset variable
    (about a microsecond each); CPython's POSIX ``os.environ`` keeps a bytes
    dict that answers the same question with a plain lookup, and stays in
    sync with every assignment through ``os.environ``.
    """
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(data, dict):
        get = data.get
        return lambda: (get(b"KVSPLIT_MODE"), get(b"KVSPLIT_MAX_SPLIT"), get(b"KVSPLIT_DB"),
                        get(b"KVSPLIT_PDL"))
    get = os.environ.get
    return lambda: (get("KVSPLIT_MODE"), get("KVSPLIT_MAX_SPLIT"), get("KVSPLIT_DB"),
                    get("KVSPLIT_PDL"))


read_environment = _read_environment = _environment_reader()


def _text(raw) -> str | None:
    return os.fsdecode(raw) if isinstance(raw, bytes) else raw


def pdl_enabled() -> bool:
    """Whether launches use programmatic dependent launch: ``KVSPLIT_PDL=1``; unset, empty
    or ``0`` is off, anything else an InvalidSetting (like the other variables)."""
    value = os.environ.get("KVSPLIT_PDL", "")
    if value not in ("", "0", "1"):
        raise InvalidSetting(f"KVSPLIT_PDL must be 0 or 1; got {value!r}")
    return value == "1"


def heuristic(num_splits: int) -> int:
    """K such that each group gets about one batch of 4 partials (before constraints)."""
    target = max(1, num_splits // 4)
    return max(k for k in KV_SPLITS if k <= target)


@dataclass(frozen=True)
class Decision:
    """What the slow path chose for one shape, and why."""

    config: KernelConfig
    source: str          # forced, mode, database, shipped, tuned, heuristic, capture
    key: object = None   # the TuningKey, when one was looked up
    record: object = None  # the TuningRecord, when tuned in this process


# Where a fast key (built in Dispatcher.choose_config, unpacked in _slow) holds the
# environment tuple.
_ENVIRONMENT = 8


class Dispatcher:
    """Chooses the kernel config (family and parameters) per call; thread-safe; one per process
    (see :data:`dispatcher`)."""

    def __init__(self, launches: LaunchTable | None = None) -> None:
        """``launches``: the launch table whose layouts hold this dispatcher's choices
        (cleared when they change); a table of its own if None."""
        self._fast: dict[tuple, KernelConfig] = {}
        self._decisions: dict[tuple, Decision] = {}
        self._lock = threading.RLock()
        self._key_locks: dict[object, threading.Lock] = {}
        self._tables: dict[tuple, dict] = {}
        self._generations: dict[tuple, object] = {}  # per table: the generation it was loaded at
        # Per table: winners profiled here whose write has not finished. A reload keeps
        # them, or a key profiled but not yet stored would be profiled again.
        self._unstored: dict[tuple, dict] = {}
        self._store = None
        self._store_url: str | None = None
        self._store_in_memory = False  # as opened: a store that fell back to memory later is not refreshed
        self._store_reopened = 0  # the store's count of reopened files that the tables have seen
        #: The eager merges' launches per call layout (each holds a choice of this dispatcher).
        self.launches = LaunchTable() if launches is None else launches
        # Child hooks run in the order registered: the pool goes before a refresh thread starts.
        os.register_at_fork(after_in_child=_forget_pool(self))
        self._refresher = Refresher(self.refresh)

    # -- hot path ---------------------------------------------------------------------------
    def choose_config(self, facts: DeviceFacts, device: torch.device, head_dim: int,
                      partial_dtype: torch.dtype, out_dtype: torch.dtype, stats_format: int,
                      num_splits: int, rows: int, forced: int | None,
                      scattered: bool = False) -> tuple[KernelConfig, bool]:
        """The config and whether it is cached (a launch that holds it may be kept).

        ``scattered``: the stats of adjacent rows are apart (see keys.py's layout class).
        """
        fast_key = (facts, head_dim, partial_dtype, out_dtype, stats_format, num_splits, rows,
                    forced, _read_environment(), scattered)
        config = self._fast.get(fast_key)
        if config is not None:
            return config, True
        decision = self._slow(fast_key, device)
        return decision.config, decision.source != "capture"

    # -- slow path --------------------------------------------------------------------------
    def explain(self, facts: DeviceFacts, head_dim: int, partial_dtype: torch.dtype,
                out_dtype: torch.dtype, stats_format: int, num_splits: int, rows: int,
                forced: int | None = None, scattered: bool = False) -> Decision | None:
        """The decision behind the cached choice for this shape, if it was made."""
        return self._decisions.get((facts, head_dim, partial_dtype, out_dtype, stats_format,
                                    num_splits, rows, forced, _read_environment(), scattered))

    def _slow(self, fast_key: tuple, device: torch.device) -> Decision:
        (facts, head_dim, partial_dtype, out_dtype, stats_format, num_splits, rows, forced,
         environment, scattered) = fast_key
        mode, max_split_raw, db_url, _ = (_text(raw) for raw in environment)
        mode, fixed, max_split = read_settings(mode, max_split_raw)

        def constrained(config: KernelConfig) -> KernelConfig:
            return constrain_config(config, head_dim=head_dim, elem_bytes=partial_dtype.itemsize,
                                    rows=rows, num_splits=num_splits,
                                    sm_count=facts.sm_count if facts.is_cuda else None,
                                    max_split=max_split)

        capturing = (facts.is_cuda and torch.cuda.is_available()
                     and torch.cuda.is_current_stream_capturing())
        if forced:
            decision = Decision(constrained(kvsplit_config(forced)), "forced")
        elif mode == "off":
            decision = Decision(kvsplit_config(1), "mode")
        elif fixed is not None:
            decision = Decision(constrained(fixed), "mode")
        else:
            decision = self._lookup(facts, device, head_dim, partial_dtype, out_dtype,
                                    stats_format, num_splits, rows, mode, max_split, db_url,
                                    capturing, constrained, scattered)
        if decision.source != "capture":
            with self._lock:
                self._fast[fast_key] = decision.config
                self._decisions[fast_key] = decision
        return decision

    def _lookup(self, facts, device, head_dim, partial_dtype, out_dtype, stats_format,
                num_splits, rows, mode, max_split, db_url, capturing, constrained,
                scattered=False) -> Decision:
        key = tuning_key(facts, build_hash(facts.is_cuda), head_dim, dtype_name(partial_dtype),
                         dtype_name(out_dtype), STATS_FORMATS[stats_format], num_splits, rows,
                         scattered)
        loaded = (facts, key.build_hash, db_url) not in self._tables
        stored = self._table(facts, key.build_hash, db_url).get(key.choice_key)
        if stored is None and not loaded and refresh_interval() is not None and self.refresh():
            # A miss: another process may have stored this key since the table was read.
            stored = self._table(facts, key.build_hash, db_url).get(key.choice_key)
        if stored is not None:
            return Decision(constrained(stored), "database", key)
        # A shipped record that never timed a family the tuner would time now is, in auto, a
        # miss whose winner stands in for the heuristic until the key is profiled.
        shipped = _shipped_table(facts).get(key.choice_key)
        if shipped is not None and (mode == "cached" or not _untimed_families(facts, key, (rows, num_splits))):
            return Decision(constrained(shipped), "shipped", key)
        fallback = kvsplit_config(heuristic(num_splits))
        if mode == "cached":
            return Decision(constrained(fallback), "heuristic", key)
        if capturing:
            from . import pending as pending_keys  # the store's side loads on a table miss

            pending_keys.add(key)
            return Decision(constrained(fallback if shipped is None else shipped), "capture", key)
        return self._tune(facts, device, key, (rows, num_splits), db_url, constrained, fallback)

    def _tune(self, facts, device, key, shape, db_url, constrained, fallback) -> Decision:
        from ..autotune import tuner  # loaded at the first profile, with the store's side
        from . import pending as pending_keys

        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # concurrent callers of one key profile it once
            table = self._table(facts, key.build_hash, db_url)
            stored = table.get(key.choice_key)
            if stored is not None:
                return Decision(constrained(stored), "database", key)
            need = tuner.scratch_bytes(tuner.at_shape(key, shape))
            free = free_memory(facts, device)
            if free is not None and need > PROFILE_MEMORY_SHARE * free:
                pending_keys.add(key)
                warnings.warn(f"kvsplit: {key.shape_label} is not profiled at first use: its "
                              f"scratch inputs would take {need / 2 ** 30:.2f} GiB of the "
                              f"{free / 2 ** 30:.2f} GiB free; calls of this shape use the "
                              f"heuristic config {fallback.label} (`kvsplit tune --pending` "
                              f"tunes the key ahead of time)", RuntimeWarning, stacklevel=2)
                return Decision(constrained(fallback), "heuristic", key)
            # Tuned without the caller's cap: the record goes to a shared
            # database; the cap applies to this call through constrained().
            configs = configs_for_key(key, is_cuda=facts.is_cuda, shape=shape)
            log.info("kvsplit: profiling %d candidate configs%s for %s at first use "
                     "(`kvsplit tune` ahead of time, or KVSPLIT_MODE=cached, avoids this)",
                     len(configs), " (before pruning)" if facts.is_cuda else "", key.shape_label)
            try:
                # Profiled at this call's own shape, which the record then serves for the
                # whole bucket.
                record = tuner.tune(key, device, configs=configs, shape=shape)
            except tuner.NoWorkingCandidate as error:
                warnings.warn(f"kvsplit: {error}; calls of this shape use the heuristic config "
                              f"{fallback.label}", RuntimeWarning, stacklevel=2)
                return Decision(constrained(fallback), "heuristic", key)
            table_key = (facts, key.build_hash, db_url)
            with self._lock:
                table[key.choice_key] = record.winner
                self._unstored.setdefault(table_key, {})[key.choice_key] = record.winner
            try:
                store = self._open_store(db_url)
                before = self._generations.get(table_key)
                store.upsert(record)
                self._own_write(store, db_url, before)
            finally:
                with self._lock:  # after the write: a reload from now on reads it from the database
                    unstored = self._unstored.get(table_key, {})
                    unstored.pop(key.choice_key, None)
                    if not unstored:
                        self._unstored.pop(table_key, None)
            pending_keys.discard(key)
            log.info("kvsplit: tuned %s -> %s", key.shape_label, record.winner.label)
            return Decision(constrained(record.winner), "tuned", key, record)

    def _open_store(self, db_url: str | None):
        with self._lock:
            if self._store is None or self._store_url != db_url:
                # A short busy timeout: a serving process must not stall for
                # long behind another process's write lock.
                from .. import db  # the store loads at its first use: a table miss

                self._store = db.open_store_for_library(db_url, timeout_s=_LIBRARY_DB_TIMEOUT_S,
                                                        config_type=KernelConfig)
                self._store_url = db_url
                self._store_in_memory = self._store.in_memory
                self._store_reopened = self._store.reopened
            return self._store

    def _table(self, facts: DeviceFacts, build_hash: str, db_url: str | None) -> dict:
        with self._lock:
            table = self._tables.get((facts, build_hash, db_url))
            if table is None:
                refresh_interval()  # an invalid KVSPLIT_REFRESH_S raises here, on the caller's call
                store = self._open_store(db_url)
                # The generation first: a write between the two reads makes the next check reload.
                generation = store.generation()
                table = store.load_choices(device_info(facts), build_hash)
                self._tables[(facts, build_hash, db_url)] = table
                self._generations[(facts, build_hash, db_url)] = generation
                if not store.in_memory:
                    self._refresher.start()
            return table

    def _own_write(self, store, url: str | None, before) -> None:
        """After this process stored one record: the tables that were current before it stay
        current, so that the next miss does not reload a whole table for a row this process
        already holds (docs/history.md, "First-use time"). Only when the counter moved by exactly
        one, i.e. no other writer came in between; otherwise the next check reloads."""
        if store.in_memory or not (before is None or type(before) is int):
            return
        after = store.generation()
        if after != (1 if before is None else before + 1):
            return
        with self._lock:
            for table_key, generation in self._generations.items():
                if table_key[2] == url and generation == before:
                    self._generations[table_key] = after

    def refresh(self) -> bool:
        """Reload the cached tables if the database changed since they were read; whether any did.

        One query (the generation counter) when nothing changed. On a change,
        every cached choice whose stored winner changed (or that a new winner
        now covers) is dropped, and so is every launch of the launch table
        (:attr:`launches`): the next call of those shapes chooses again, once.
        A store that fell back to memory after a database problem (or after
        its file was deleted) is left alone: the tables read before it keep
        serving. After the store reopened a file that replaced its own, every
        table is read again.
        """
        with self._lock:
            store, url = self._store, self._store_url
            if store is None or store.in_memory != self._store_in_memory:
                return False
            current = store.generation()  # the store checks its file first (see kvsplit.db.engine.FileWatch)
            if store.in_memory != self._store_in_memory:  # that very read failed over to memory
                return False
            reopened, self._store_reopened = store.reopened != self._store_reopened, store.reopened
            stale = [k for k in self._tables
                     if k[2] == url and (reopened or self._generations.get(k) != current)]
            if not stale or (current is None and not reopened):
                return False
            changed = False
            for table_key in stale:
                facts, build, _ = table_key
                table = self._tables[table_key]
                fresh = store.load_choices(device_info(facts), build)
                fresh.update(self._unstored.get(table_key, {}))  # profiled here, being stored
                self._generations[table_key] = current
                moved = {k for k in table.keys() | fresh.keys() if table.get(k) != fresh.get(k)}
                if not moved:
                    continue
                changed = True
                table.clear()  # in place: a profile in flight still holds this dict
                table.update(fresh)
                self._drop_decisions(facts, build, url, moved)
            if changed:
                self.launches.clear()
                log.info("kvsplit: the tuning database changed (generation %s): new winners in use", current)
            return changed

    def _drop_decisions(self, facts: DeviceFacts, build: str, url: str | None, moved: set) -> None:
        for fast_key, decision in list(self._decisions.items()):
            if (decision.source in _TABLE_SOURCES and decision.key is not None and fast_key[0] == facts
                    and decision.key.build_hash == build and _text(fast_key[_ENVIRONMENT][2]) == url
                    and decision.key.choice_key in moved):
                del self._decisions[fast_key]
                self._fast.pop(fast_key, None)

    def forget(self) -> None:
        """Drop every cached choice and table (they are re-read on the next call)."""
        with self._lock:
            self._fast.clear()
            self._decisions.clear()
            self.launches.clear()
            self._tables.clear()
            self._generations.clear()
            self._unstored.clear()
            if self._store is not None:
                self._store.close()
            self._store = None


def _forget_pool(dispatcher: Dispatcher):
    """An at-fork hook: the child must not use the parent's pooled database connections."""
    ref = weakref.ref(dispatcher)

    def hook() -> None:
        owner = ref()
        if owner is not None and owner._store is not None:
            owner._store.after_fork()
    return hook


class _ShippedTable(dict):
    """A device's shipped winners per choice key; ``timed``: per key, the families its record timed."""

    def __init__(self) -> None:
        super().__init__()
        self.timed: dict = {}


_SHIPPED: dict[DeviceFacts, _ShippedTable] = {}


def _shipped_table(facts: DeviceFacts) -> _ShippedTable:
    """Winners shipped in kvsplit/tables/*.json for this device (any kernel build)."""
    table = _SHIPPED.get(facts)
    if table is None:
        from ..export import read_export

        table = _ShippedTable()
        info = device_info(facts)
        folder = resources.files("kvsplit").joinpath("tables")
        # Files in name order: a key that two files hold takes the later file's winner.
        for entry in sorted(folder.iterdir(), key=lambda e: e.name) if folder.is_dir() else ():
            if entry.name.endswith(".json"):
                for record in read_export(entry.read_text()):
                    if record.key.device == info:
                        table[record.key.choice_key] = record.winner
                        table.timed[record.key.choice_key] = frozenset(c.config.family for c in record.candidates)
        _SHIPPED[facts] = table
    return table


def shipped_summary(facts: DeviceFacts) -> str:
    """One line on the tables shipped for this GPU (``kvsplit info``)."""
    table = _shipped_table(facts)
    if not table:
        return "none for this GPU: mode auto profiles each shape at its first call"
    return f"{len(table)} keys for this GPU (kvsplit/tables)"


def _untimed_families(facts: DeviceFacts, key, shape: tuple[int, int]) -> set[str]:
    """The families that the tuner would time for ``key`` now and its shipped record never did.

    A record that lists no candidates is taken as it is (nothing to compare).
    """
    timed = _shipped_table(facts).timed.get(key.choice_key)
    if not timed:
        return set()
    from ..autotune import tuner  # the tuner's pruning decides what it would time

    configs = configs_for_key(key, is_cuda=facts.is_cuda, shape=shape)
    if facts.is_cuda:  # judged at the call's shape, as tuner.tune prunes
        configs = tuner.prune(configs, tuner.at_shape(key, shape))
    return {config.family for config in configs} - timed


dispatcher = Dispatcher(launch_table)
choose_config = dispatcher.choose_config


def config_for_layout(request: ConfigRequest) -> tuple[KernelConfig, bool, bool]:
    """The kernel config of a call layout (:class:`kvsplit.launches.LayoutLaunch` asks),
    whether a launch holding it may be kept, and whether launches use PDL.

    The module's :func:`choose_config` chooses; a call that exports its stats in place or
    writes per-group FP8 scales then gets the config mended for those rules.
    """
    facts = device_facts(request.device)
    scattered = scattered_stats(request.stats_format == MAXSUM, request.row_shape,
                                request.stats_row_strides)
    config, cacheable = choose_config(facts, request.device, request.head_dim,
                                      request.partial_dtype, request.out_dtype,
                                      request.stats_format, request.num_splits, request.rows,
                                      request.kv_split, scattered)
    if request.few_only:
        config = few_only_config(config, head_dim=request.head_dim,
                                 elem_bytes=request.partial_dtype.itemsize,
                                 stats_in_place=request.stats_in_place)
    elif request.stats_in_place or request.quant_group:
        rules = dict(head_dim=request.head_dim, elem_bytes=request.partial_dtype.itemsize,
                     rows=request.rows, num_splits=request.num_splits,
                     sm_count=facts.sm_count if facts.is_cuda else None)
        if request.stats_in_place:
            config = in_place_config(config, **rules)
        if request.quant_group:
            config = group_quant_config(config, **rules, quant_group=request.quant_group)
    return config, cacheable, pdl_enabled()
