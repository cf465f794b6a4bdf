"""Reading the TOML tables: the shipped ones under `tables/` and users' policy files."""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterator, Mapping
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


def runtime_sections(
    document: Mapping[str, Any], source: str, required: Collection[str], optional: Collection[str] = ()
) -> Iterator[tuple[str, Mapping[str, Any], str]]:
    """The `[runtime]` tables of a per-runtime document, checked: a `[default]` table exists,
    every other table names a runtime profile (a misspelled name would silently take the
    default), and each holds the `required` keys and no key beyond `optional`. Yields
    (runtime, entry, where) with `where` naming the table for errors."""
    from mixprec.policy.profiles import RUNTIMES  # noqa: PLC0415 - profiles import this module's callers

    if "default" not in document:
        raise PolicyError(f"{source}: a [default] table is required")
    for runtime, entry in document.items():
        where = f"{source}: [{runtime}]"
        if runtime != "default" and runtime not in RUNTIMES:
            raise PolicyError(f"{where}: not a runtime profile (one of {', '.join(RUNTIMES)}, or default)")
        if not isinstance(entry, Mapping):
            raise PolicyError(f"{where}: expected a table, got {entry!r}")
        unknown = sorted(set(entry) - {*required, *optional})
        missing = [key for key in required if key not in entry]
        if unknown or missing:
            raise PolicyError(f"{where}: {'unknown' if unknown else 'missing'} key {(unknown or missing)[0]!r}")
        yield runtime, entry, where
