"""The environment flags torch_msa reads when an op runs, so that a change applies from the next call."""

import os

QUERY_OUTER_ENV = "TORCH_MSA_QUERY_OUTER"
"""Set to 1, asks the Triton and SM90 forwards to run query-outer the query groups whose tokens
share their blocks (`torch_msa/stages/README.md`)."""


def flag(name: str) -> bool:
    """Whether the environment variable `name` is set to 1, true, yes or on (any case)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def query_outer_requested() -> bool:
    """True when `QUERY_OUTER_ENV` asks the forwards for their query-outer part."""
    return flag(QUERY_OUTER_ENV)
