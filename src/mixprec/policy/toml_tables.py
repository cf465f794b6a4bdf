"""Reading the TOML tables: the shipped ones under `tables/` and users' policy files."""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

from mixprec.errors import PolicyError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """The parsed document; a `PolicyError` naming `source` when it is not valid TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{source}: not valid TOML: {e}") from e


def shipped_table(name: str) -> dict[str, Any]:
    """The parsed table `tables/<name>` shipped with the package."""
    return parse_toml(resources.files("mixprec.policy").joinpath(f"tables/{name}").read_text(), name)
