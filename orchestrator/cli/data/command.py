"""`undying data prepare`: tokenize text inputs into the format `trainer.tokens.TokenDataset` reads.

    undying data prepare INPUT... --tokenizer PATH --out URL [--text-field text] [--eos-token TOKEN]
                         [--no-add-special-tokens] [--parse-special-tokens]
                         [--address ADDR] [--storage-option KEY=VALUE ...] [--shard-tokens N]

INPUT: .txt (one document per file), .jsonl (one per line), .parquet (one per row) or a
`datasets` save_to_disk directory, as local paths or fsspec URLs; the token stream holds the
documents in the order given. On a cluster (`--address`), give inputs and output as URLs
every node can reach (s3://...), not local paths. `--storage-option` configures every
non-local location (inputs, tokenizer, output), e.g. endpoint_url=http://127.0.0.1:8333.

Exit codes: 0 prepared, or already prepared with these inputs and this tokenizer; 1 storage
failed mid-way (run the same command again: finished shards are kept); 2 the arguments or
the inputs cannot work as given, or --out holds another dataset: one line naming the
argument and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from ckpt.storage_options import explain
from orchestrator.cli.ckpt_cmd import error_reason, is_storage_error
from orchestrator.cli.exits import EXIT_FAILED, EXIT_USAGE, UsageError
from orchestrator.cli.storage_args import add_storage_option_args, parse_storage_options

COMMAND = "undying data prepare"
# 4M tokens (about 16 MiB of text, 8 MiB of uint16 ids) per shard and task: small enough that a
# corpus of a few hundred MiB keeps two cores busy to the end and a task's memory (its text,
# then its tokens) stays well under a worker's, large enough that a terabyte is tens of
# thousands of files, not millions.
DEFAULT_SHARD_TOKENS = 2**22


def add_data_parser(sub) -> None:
    data = sub.add_parser("data", help="prepare tokenized training data")
    actions = data.add_subparsers(dest="data_command", required=True)
    p = actions.add_parser("prepare", help="tokenize text inputs into shards of token ids, on Ray Data")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help=".txt, .jsonl, .parquet files or datasets save_to_disk directories, in stream order")
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="a tokenizers tokenizer.json, or a directory holding one")
    p.add_argument("--out", required=True, metavar="URL", help="where the dataset goes (a path or fsspec URL)")
    p.add_argument("--text-field", default="text", help="the text key (.jsonl) or column (.parquet, datasets)")
    p.add_argument("--eos-token", help="the token appended after each document (default: from the tokenizer's "
                   "directory, else the first of </s>, <|endoftext|>, <eos> in the vocabulary)")
    p.add_argument("--add-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="encode each document as transformers' tokenizer(text) does, through the tokenizer's "
                   "post-processor (a Llama tokenizer's BOS first); --no-add-special-tokens: the text's ids alone "
                   "(default: on)")
    p.add_argument("--parse-special-tokens", action="store_true",
                   help="special tokens written in a document (a chat template's <|eot_id|>) are their ids; "
                   "without it they are their characters, so web text naming </s> makes no document boundary")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else embedded local Ray)")
    add_storage_option_args(p, "fsspec option for non-local locations, e.g. endpoint_url=http://host:8333 (repeatable)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"about this many tokens per shard and task (default {DEFAULT_SHARD_TOKENS})")


def data_main(args: argparse.Namespace, executor=None) -> int:
    """Run `undying data <command>`; `executor` replaces Ray Data (tests run units in-process)."""
    from orchestrator.cli.data.execute import RayDataExecutor
    from orchestrator.cli.data.prepare import PrepareRequest, prepare

    try:
        request = PrepareRequest(inputs=args.inputs, tokenizer=args.tokenizer, out=args.out,
                                 text_field=args.text_field, eos_token=args.eos_token,
                                 storage_options=parse_storage_options(args.storage_options, args.storage_options_file),
                                 shard_tokens=args.shard_tokens, add_special_tokens=args.add_special_tokens,
                                 parse_special_tokens=args.parse_special_tokens)
        return prepare(request, executor or RayDataExecutor(args.address))
    except UsageError as err:
        print(f"{COMMAND}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:
        if not is_storage_error(err):
            raise
        words = explain(err, "--storage-option")  # missing credentials: no rerun helps until they are set
        print(f"{COMMAND}: storage error: {error_reason(err, limit=300)}; "
              + (f"{words}, then run the same command again" if words else
                 "run the same command again (finished shards are kept)"), file=sys.stderr)
        return EXIT_USAGE if words else EXIT_FAILED
