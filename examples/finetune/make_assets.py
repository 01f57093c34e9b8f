"""Make the fine-tuning example's inputs: a small corpus, a tokenizer trained on it, a "pretrained" Llama.

    .venv/bin/python examples/finetune/make_assets.py runs/finetune

writes under the given directory:
    corpus/train-00.jsonl ... train-03.jsonl   generated documents, one per line ({"text": ...})
    corpus/val.txt                             held-out documents for the validation loss
    tokenizer/tokenizer.json (+ tokenizer_config.json)   a byte-level BPE trained with `tokenizers`
    pretrained/                                a tiny Llama-3 (GQA, scaled RoPE) as a Hugging Face
                                               directory: config.json + model.safetensors, and
                                               the tokenizer's files (as a Hub model carries them)

The text is generated here from a small grammar of arithmetic and ordering statements ("seven
plus two is nine."), so it is license-clean, deterministic and learnable: the validation loss
visibly falls within a few hundred CPU steps. The "pretrained" weights are a seeded random
initialisation written in Hugging Face's format (nothing here reaches a model hub), which the
job loads with `model.from_hf` exactly as it would a downloaded checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ckpt.hf_export import save_hf
from trainer.config import ModelConfig
from trainer.model import build_model

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]
THINGS = ["apples", "books", "stones", "birds", "boats", "lamps", "coins", "trees"]
EOS = "</s>"


def sentence(rng: random.Random) -> str:
    a, b = rng.randrange(10), rng.randrange(10)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    if kind == 1:
        big, small = max(a, b), min(a, b)
        return f"{NUMBERS[big]} minus {NUMBERS[small]} is {NUMBERS[big - small]}."
    thing = rng.choice(THINGS)
    return f"{NUMBERS[a]} {thing} and {NUMBERS[b]} {thing} make {NUMBERS[a + b]} {thing}."


def document(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randrange(3, 12)))


def write_corpus(out: Path, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    (out / "corpus").mkdir(parents=True, exist_ok=True)
    texts = []
    for shard in range(4):
        docs = [document(rng) for _ in range(600)]
        texts += docs
        with open(out / "corpus" / f"train-{shard:02d}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    (out / "corpus" / "val.txt").write_text(" ".join(document(rng) for _ in range(200)))
    return texts


def train_tokenizer(texts: list[str], out: Path, vocab_size: int = 512) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer" / "tokenizer.json"))
    config = {"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tokenizer


def write_pretrained(out: Path, tokenizer: Tokenizer) -> None:
    # The embedding is padded to a multiple of 64 rows, as Megatron and Llama do: tensor
    # parallelism splits the vocabulary evenly, and the ids past the tokenizer's are never seen.
    vocab = -(-tokenizer.get_vocab_size() // 64) * 64
    model = ModelConfig(preset="tiny-llama", vocab_size=vocab, max_seq_len=256)
    weights = dict(build_model(model, seed=0).named_parameters())
    save_hf(model, weights, str(out / "pretrained"), token_ids={"eos_token_id": tokenizer.token_to_id(EOS)})
    # As a model directory from the Hub, it holds its tokenizer: `undying run` checks the prepared
    # data against it (data prepared with another tokenizer would mean other words to these weights).
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(out / "tokenizer" / name, out / "pretrained" / name)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    tokenizer = train_tokenizer(write_corpus(out), out)
    write_pretrained(out, tokenizer)
    print(f"wrote {out}/corpus, {out}/tokenizer (vocab {tokenizer.get_vocab_size()}) and {out}/pretrained")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
