"""The storage-option arguments of the commands that work on a URL (`undying ckpt`, `eval`, `data`).

`--storage-option KEY=VALUE` is for what may show in `ps` and Ray's job list (an endpoint, a
region); a credential-looking key is refused (orchestrator.spec.secrets). Credentials come from
the environment or `--storage-options-file PATH`; the flags override the file's keys.
"""

from __future__ import annotations

import argparse
import json

from orchestrator.cli.exits import UsageError
from orchestrator.spec.secrets import FIX, credential_keys, read_options_file


def add_storage_option_args(p: argparse.ArgumentParser, help_text: str) -> None:
    """`--storage-option KEY=VALUE` (no credentials: they would show in `ps`) and `--storage-options-file`."""
    p.add_argument("--storage-option", dest="storage_options", action="append", default=[],
                   metavar="KEY=VALUE", help=help_text + "; credentials go in the environment or "
                   "--storage-options-file, never here")
    p.add_argument("--storage-options-file", metavar="PATH", help="a YAML or JSON file of fsspec storage "
                   "options, e.g. {endpoint_url: ..., key: ..., secret: ...}: the place for credentials")


def parse_storage_options(items: list[str], file: str | None = None) -> dict:
    """The options of the `--storage-option` flags over those of `file`; a UsageError for a
    malformed flag, an unreadable file, or a credential given as a flag."""
    options: dict = {}
    if file is not None:
        try:
            options = read_options_file(file)
        except ValueError as err:
            raise UsageError(f"--storage-options-file {err}") from None
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--storage-option expects KEY=VALUE, got {item!r}; e.g. "
                             "--storage-option endpoint_url=http://127.0.0.1:8333")
        parsed = _option_value(value)
        secret = credential_keys({key.strip(): parsed})
        if secret:
            raise UsageError(f"--storage-option {secret[0]}=...: refused, a credential on the command line "
                             f"({FIX}, given with --storage-options-file PATH)")
        options[key.strip()] = parsed
    return options


def _option_value(value: str):
    # Strings by default: secrets and keys may look like numbers and must stay strings.
    if value in ("true", "false"):
        return value == "true"
    if value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise UsageError(f"--storage-option value {value!r} is not valid JSON ({err})") from None
    return value
