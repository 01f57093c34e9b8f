"""Generate a few tokens with transformers from a directory `undying ckpt export --format hf` wrote.

    .venv/bin/python examples/finetune/generate.py runs/finetune/exported "three plus four is"

transformers is a test dependency (`pip install -e .[test]`), not one of undying's: this is the
last step of the fine-tuning example, showing that what undying exports is an ordinary model.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: generate.py EXPORTED_DIR PROMPT", file=sys.stderr)
        return 2
    directory, prompt = argv
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{directory}/tokenizer.json", eos_token="</s>")
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    print(tokenizer.decode(out[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
