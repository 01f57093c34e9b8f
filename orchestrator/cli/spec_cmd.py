"""`undying spec --schema | --markdown`: the job spec's reference, generated from its models.

    undying spec --schema      JSON Schema of a job spec (draft 2020-12), for editors and CI
    undying spec --markdown    the reference docs/spec.md holds: every field's path, type,
                               default, constraints and description

Both come from orchestrator.spec.reference; nothing is read or probed. Exit code 0.
"""

from __future__ import annotations

import argparse
import json

from orchestrator.cli.exits import EXIT_OK


def add_spec_parser(sub) -> None:
    p = sub.add_parser("spec", help="print the job spec's JSON Schema or its field reference (docs/spec.md)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--schema", action="store_true", help="JSON Schema of a job spec, e.g. for an editor")
    what.add_argument("--markdown", action="store_true", help="the field reference, as docs/spec.md holds it")


def spec_main(args: argparse.Namespace) -> int:
    from orchestrator.spec.reference import json_schema, markdown

    if args.schema:
        print(json.dumps(json_schema(), indent=2, sort_keys=False))
    else:
        print(markdown(), end="")
    return EXIT_OK
