"""The environment flags torch_msa reads when an op runs, so that a change applies from the next call."""

import os

QUERY_OUTER_ENV = "TORCH_MSA_QUERY_OUTER"
"""How the SM90 and Triton forwards use their query-outer part (`torch_msa/stages/README.md`):
unset or `auto`, the default: the SM90 forward, on the GPUs the default was measured on
(`torch_msa.sm90.common.runs_query_outer_by_default`), runs query-outer the query groups the
plan's rule picks in the documents the default's rule admits
(`torch_msa.plan.groups.default_min_queries`), the Triton forward none; `1` (true, yes, on):
both forwards, in every document and at every head layout; `0` (false, no, off): neither."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(name: str) -> bool:
    """Whether the environment variable `name` is set to 1, true, yes or on (any case)."""
    return os.environ.get(name, "").strip().lower() in _TRUE


def query_outer_setting() -> str:
    """`QUERY_OUTER_ENV` read as `"auto"`, `"on"` or `"off"`.

    Raises:
        ValueError: any other value, named with the values it takes.
    """
    value = os.environ.get(QUERY_OUTER_ENV, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in _TRUE:
        return "on"
    if value in _FALSE:
        return "off"
    raise ValueError(f"{QUERY_OUTER_ENV}: expected auto, 1 (true, yes, on) or 0 (false, no, off), "
                     f"got {os.environ[QUERY_OUTER_ENV]!r}")
