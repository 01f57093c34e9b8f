"""The pure parts of `undying data prepare`: cutting inputs into units, reading a .jsonl piece
by byte range, and choosing the end-of-document token. No Ray, no tokenization."""

from __future__ import annotations

import io
import json
import random

import pytest
from tokenizers import Tokenizer, models

from orchestrator.cli.data.records import BadRecord, _jsonl
from orchestrator.cli.data.sources import Source, SourceFile
from orchestrator.cli.data.units import Piece, plan_units
from orchestrator.cli.data.vocab import load_tokenizer, resolve_eos
from orchestrator.cli.exits import UsageError


def src(kind: str, *sizes, atoms=None) -> Source:
    files = tuple(SourceFile(url=f"file:///x/{kind}{i}", size=s, version="1",
                             atoms=() if kind == "jsonl" else (atoms or (s,))) for i, s in enumerate(sizes))
    return Source(arg=f"{kind}-input", url=f"file:///x/{kind}", kind=kind, files=files)


def covered(units, sources) -> dict[tuple[int, int], list[tuple[int, int]]]:
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for unit in units:
        for p in unit.pieces:
            spans.setdefault((p.source, p.file), []).append((p.start, p.stop))
    return spans


def test_units_follow_stream_order_and_cover_every_byte_once():
    sources = [src("txt", 10), src("txt", 15), src("jsonl", 250), src("parquet", 0, atoms=(40, 40, 200, 5)),
               src("arrow", 90, 10), src("jsonl", 0)]
    units = plan_units(sources, budget_bytes=100)
    assert [u.index for u in units] == list(range(len(units)))
    flat = [(p.source, p.file, p.start, p.stop) for u in units for p in u.pieces]
    assert flat == sorted(flat), "pieces must come in stream order"
    spans = covered(units, sources)
    assert spans[(2, 0)] == [(0, 75), (75, 175), (175, 250)]  # the jsonl tops up the first unit, then fills
    # Row groups are never cut: the big one closes its unit past the budget.
    assert spans[(3, 0)] == [(0, 1), (1, 3), (3, 4)]
    assert spans[(4, 0)] == [(0, 1)] and spans[(4, 1)] == [(0, 1)]
    assert (5, 0) not in spans  # an empty .jsonl holds no record
    assert [u.est_bytes for u in units] == [100, 100, 115, 240, 105]


def test_small_files_share_a_unit_and_a_big_file_is_its_own():
    units = plan_units([src("txt", 5), src("txt", 5), src("txt", 500), src("txt", 5)], budget_bytes=50)
    assert [[p.source for p in u.pieces] for u in units] == [[0, 1, 2], [3]]


@pytest.mark.parametrize("seed", range(20))
def test_jsonl_byte_ranges_hold_every_record_exactly_once(seed):
    rng = random.Random(seed)
    lines = []
    for i in range(rng.randint(0, 30)):
        if rng.random() < 0.15:
            lines.append(" " * rng.randint(0, 3))
        else:
            lines.append(json.dumps({"text": "t" * rng.randint(0, 40) + f"-{i}", "k": i}))
    data = ("\n".join(lines) + ("\n" if rng.random() < 0.5 else "")).encode()
    expected = [json.loads(line)["text"] for line in lines if line.strip()]
    cuts = sorted({0, len(data), *(rng.randint(0, len(data)) for _ in range(rng.randint(0, 8)))})
    got = []
    source = src("jsonl", len(data))
    for start, stop in zip(cuts, cuts[1:], strict=False):
        got += [text for text, _ in _jsonl(source, io.BytesIO(data), start, stop, "text")]
    assert got == expected


def test_jsonl_bad_records_name_the_line_and_the_fix():
    source = src("jsonl", 0)
    cases = [(b'{"text": "ok"}\n\xff\xfe\n', r"the line at byte 15 is not valid UTF-8"),
             (b'{"text": "ok"}\n{"text": \n', r"the line at byte 15 is not valid JSON"),
             (b'{"body": "x"}\n', r"--text-field text: the line at byte 0 of jsonl-input has no field 'text' "
                                  r"\(it has 'body'\)"),
             (b'[1, 2]\n', r"is a JSON list, not an object"),
             (b'{"text": 3}\n', r"has int in 'text', not a string"),
             (b'{"text": null}\n', r"has no text \(null in 'text'\)")]
    for data, message in cases:
        with pytest.raises(BadRecord, match=message):
            list(_jsonl(source, io.BytesIO(data), 0, len(data), "text"))


VOCAB = {"<unk>": 0, "a": 1, "</s>": 2, "<|endoftext|>": 3, "<eos>": 4, "<end>": 5}


def test_eos_order_explicit_then_directory_then_defaults():
    assert resolve_eos(VOCAB, "<end>", {"eos_token": "</s>"}) == ("<end>", 5)
    assert resolve_eos(VOCAB, None, {"eos_token": "<eos>", "eos_token_id": 3}) == ("<eos>", 4)
    assert resolve_eos(VOCAB, None, {"eos_token_id": 5}) == ("<end>", 5)
    assert resolve_eos(VOCAB, None, {}) == ("</s>", 2)
    assert resolve_eos({k: v for k, v in VOCAB.items() if k != "</s>"}, None, {}) == ("<|endoftext|>", 3)
    with pytest.raises(UsageError, match=r"--eos-token '<nope>': not in the tokenizer's vocabulary"):
        resolve_eos(VOCAB, "<nope>", {})
    with pytest.raises(UsageError, match=r"--eos-token: the vocabulary holds none of .*pass --eos-token"):
        resolve_eos({"a": 0, "b": 1}, None, {})


def save_word_level(path, vocab: dict[str, int]) -> None:
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path))


def test_tokenizer_directory_configs_and_identity(tmp_path):
    directory = tmp_path / "tok"
    directory.mkdir()
    save_word_level(directory / "tokenizer.json", VOCAB)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}}))
    spec = load_tokenizer(str(directory), None, {})
    assert (spec.eos_token, spec.eos_id, spec.vocab_size, spec.dtype) == ("<eos>", 4, 6, "uint16")
    assert spec.source == f"file://{directory}/tokenizer.json"
    (directory / "tokenizer_config.json").unlink()
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
    assert load_tokenizer(str(directory), None, {}).eos_id == 5
    big = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    save_word_level(tmp_path / "big.json", big)
    spec = load_tokenizer(str(tmp_path / "big.json"), None, {})
    assert (spec.vocab_size, spec.dtype, spec.eos_id) == (70_002, "uint32", 1)


def test_tokenizer_mistakes_name_the_flag(tmp_path):
    with pytest.raises(UsageError, match=r"--tokenizer .*nothing.json: no such file or directory"):
        load_tokenizer(str(tmp_path / "nothing.json"), None, {})
    with pytest.raises(UsageError, match=r"--tokenizer .* has no tokenizer.json; give a tokenizer.json"):
        load_tokenizer(str(tmp_path), None, {})
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(UsageError, match=r"--tokenizer .*bad.json: not a Hugging Face tokenizers tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"), None, {})


def test_pieces_are_frozen_models():
    piece = Piece(source=0, file=0, start=0, stop=1)
    with pytest.raises(ValueError):
        piece.start = 3  # type: ignore[misc]


def test_an_input_that_changes_after_its_plan_or_while_it_is_read_is_refused(tmp_path):
    import os

    from orchestrator.cli.data.records import iter_documents
    from orchestrator.cli.data.sources import resolve_sources

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(4)))
    [source] = resolve_sources([str(path)], "text", {})
    [file] = source.files
    piece = Piece(source=0, file=0, start=0, stop=file.size)
    assert [text for text, _ in iter_documents(source, file, piece, "text", {})] == [f"doc {i}" for i in range(4)]

    documents = iter_documents(source, file, piece, "text", {})
    next(documents)
    with open(path, "a") as f:  # appended while the piece is read
        f.write(json.dumps({"text": "late"}) + "\n")
    with pytest.raises(BadRecord, match=r"INPUT .*in.jsonl: .* changed while it was being prepared \(size 72 -> 89"):
        list(documents)

    stat = os.stat(path)
    path.write_text(path.read_text()[:file.size])  # the planned size again, but another version
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(BadRecord, match="changed while it was being prepared"):
        next(iter_documents(source, file, piece, "text", {}))


def test_an_empty_text_file_is_no_document(tmp_path):
    from orchestrator.cli.data.records import iter_documents
    from orchestrator.cli.data.sources import resolve_sources

    (tmp_path / "empty.txt").write_bytes(b"")
    [source] = resolve_sources([str(tmp_path / "empty.txt")], "text", {})
    assert list(iter_documents(source, source.files[0], Piece(source=0, file=0, start=0, stop=1), "text", {})) == []
