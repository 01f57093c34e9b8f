"""Storage credentials: where they may come from, and where they must never go.

Credentials reach fsspec in one of three ways: the environment (s3fs and botocore read
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_PROFILE` themselves),
a file of storage options (`storage_options_file` in the `checkpoint`, `data`, `eval` and `model`
sections, `--storage-options-file` for the `undying ckpt`, `eval`, `report` and `data` commands), or
the `storage_options` mapping of the YAML spec itself. Never the command line: an argument
shows in `ps`, in the shell's history and in Ray's job list, so `--set` and
`--storage-option` refuse a credential-looking key (exit 2, naming the flag and the fix).

Protocol: `orchestrator.spec.job_spec.validate_spec` calls `resolve_storage_files` on the
parsed YAML (driver only, before validation), so a validated JobSpec carries the options
inline and the ranks, which may run on hosts without the file, get them with the spec
through Ray. `yaml_input.apply_overrides` calls `command_line_credentials` on each `--set`.
`spec_hash` leaves storage options out entirely (job_spec.HASH_EXCLUDED), so no secret
reaches a manifest; nothing prints a spec's storage options.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import yaml

from orchestrator.spec.problems import Problem
from orchestrator.spec.yaml_loader import UniqueKeyLoader

# Sections whose `storage_options` may come from a file.
STORAGE_SECTIONS = ("checkpoint", "data", "eval", "model")
FILE_KEY = "storage_options_file"
# A key naming a credential: key, secret, token, password, session, credential, auth (any case,
# anywhere in the key: aws_secret_access_key, client_kwargs.aws_session_token, ...).
_CREDENTIAL = re.compile(r"key|secret|token|passw|session|credential|auth", re.IGNORECASE)
FIX = ("arguments show in `ps` and in Ray's job list; give credentials in the environment "
       "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) or in a file of storage options")


def looks_like_credential(key: Any) -> bool:
    return isinstance(key, str) and _CREDENTIAL.search(key) is not None


def credential_keys(value: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every credential-looking key in `value` (nested mappings and lists)."""
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            here = f"{prefix}.{key}" if prefix else str(key)
            found += [here] if looks_like_credential(key) else credential_keys(item, here)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += credential_keys(item, f"{prefix}[{i}]")
    return found


def command_line_credentials(path: list[str], value: Any) -> list[str]:
    """Credential-looking keys that a `--set path=value` would put into some storage options."""
    if "storage_options" in path:
        inside = path[path.index("storage_options") + 1:]
        if any(looks_like_credential(part) for part in inside):
            return [".".join(path)]
        return credential_keys(value, ".".join(path))
    if isinstance(value, Mapping):  # a whole section, e.g. --set 'checkpoint={url: .., storage_options: {..}}'
        return [hit for key, item in value.items()
                for hit in command_line_credentials([*path, str(key)], item)]
    return []


def read_options_file(path: str, base_dir: str | None = None) -> dict[str, Any]:
    """The mapping of fsspec options in the YAML or JSON file at `path` (relative to `base_dir`,
    else to the working directory). Raises ValueError saying what is wrong and how to fix it;
    the message never quotes the file's contents."""
    full = os.path.join(base_dir or os.getcwd(), os.path.expanduser(path))
    try:
        with open(full, encoding="utf-8") as f:
            data = yaml.load(f, Loader=UniqueKeyLoader)
    except (OSError, UnicodeDecodeError) as error:
        reason = "not UTF-8 text" if isinstance(error, UnicodeDecodeError) else error.strerror
        where = "" if os.path.isabs(os.path.expanduser(path)) else f" (read as {full}" + (
            ": a relative path is taken from the spec's directory)" if base_dir else ")")
        raise ValueError(f"{path} cannot be read ({reason}){where}; give the path of a YAML or JSON file "
                         "of storage options, e.g. {key: ..., secret: ...}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ValueError(f"{path} is not valid YAML or JSON{where}; fix its syntax") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"{path} does not hold a mapping of option names to values; write e.g. "
                         "{endpoint_url: http://host:8333, key: ..., secret: ...}")
    return data


def resolve_storage_files(data: Mapping[str, Any], base_dir: str | None = None) -> tuple[dict, list[Problem]]:
    """A copy of the parsed spec `data` with each section's `storage_options_file` read into its
    `storage_options` (a key given in both places is a problem: which one wins would be a guess)."""
    out, problems = dict(data), []
    for name in STORAGE_SECTIONS:
        section = out.get(name)
        if not isinstance(section, Mapping) or FILE_KEY not in section:
            continue
        section = dict(section)
        path, field = section.pop(FILE_KEY), f"{name}.{FILE_KEY}"
        out[name] = section
        if not isinstance(path, str) or not path.strip():
            problems.append(Problem(field, "expected the path of a YAML or JSON file of storage options"))
            continue
        try:
            from_file = read_options_file(path, base_dir)
        except ValueError as error:
            problems.append(Problem(field, str(error)))
            continue
        inline = section.get("storage_options") or {}
        if not isinstance(inline, Mapping):
            continue  # the section's own validation reports it
        both = sorted(set(inline) & set(from_file))
        if both:
            problems.append(Problem(field, f"{path} and {name}.storage_options both set {', '.join(both)}; "
                                    "keep each option in one place"))
            continue
        section["storage_options"] = {**inline, **from_file}
    return out, problems
