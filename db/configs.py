"""Registry of kernel families and the integer parameters each one takes.

A tuning candidate (and a winner) is a *config*: a family name plus integer
parameters.  Validation of every config that enters the database goes through
:func:`check_config`, so adding a family is one line in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Mapping

#: family name -> {parameter name -> allowed values}.
FAMILIES: dict[str, dict[str, tuple[int, ...]]] = {
    "kvsplit": {"kv_split": (1, 2, 4, 8, 16)},
    "dsplit": {"depth": (4, 8), "kv_split": (1, 2, 4, 8, 16, 32, 64, 128),
               "slices": (1, 2, 4, 8, 16)},
}

#: The family and parameters that speed-ups are measured against (KvSplit = 1).
BASELINE_FAMILY = "kvsplit"
BASELINE_PARAMS: dict[str, int] = {"kv_split": 1}


def check_config(family: str, params: Mapping[str, int]) -> None:
    """Raise ``ValueError`` naming the problem if ``(family, params)`` is not a known config.

    Parameters
    ----------
    family : str
        Kernel family name, a key of :data:`FAMILIES`.
    params : mapping of str to int
        Must name exactly the family's parameters, each with an allowed value.
    """
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
