import json

import pytest
from kits.datafiles import run_cli, tiny_tokenizer, write_jsonl

from vltrain.data.tokenizers import load_tokenizer
from vltrain.errors import UserError


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_trained_tokenizer_has_the_special_tokens_and_wraps_texts(tmp_path, kind):
    tok = tiny_tokenizer(tmp_path, kind)
    assert (tok.pad_id, tok.cls_id, tok.eos_id, tok.mask_id) == (0, 2, 3, 4)
    assert tok.vocab_size > 5
    ids = tok.encode_batch(["A Red Circle", "a red circle"], max_length=32)
    assert ids[0] == ids[1]  # lowercased
    assert ids[0][0] == tok.cls_id and ids[0][-1] == tok.eos_id
    assert tok.decode(ids[0]).strip() == "a red circle"


def test_encode_truncates_and_says_so(tmp_path):
    tok = tiny_tokenizer(tmp_path)
    long = " ".join(["red circle"] * 50)
    ids, cut = tok.encode(long, 8)
    assert len(ids) == 8 and cut
    assert ids[0] == tok.cls_id and ids[-1] == tok.eos_id
    ids, cut = tok.encode("red circle", 8)
    assert len(ids) == 4 and not cut
    assert [len(x) for x in tok.encode_batch([long, "red"], 8)] == [8, 3]


def test_token_lengths_are_capped_and_zero_without_text(tmp_path):
    tok = tiny_tokenizer(tmp_path)
    assert tok.token_lengths(["red circle", None, "red " * 100], 16) == [4, 0, 16]


def test_load_from_file_or_folder(tmp_path):
    tok = tiny_tokenizer(tmp_path)
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(folder / "tokenizer.json")
    a, b = load_tokenizer(tok.path), load_tokenizer(str(folder))
    assert a.encode_batch(["left of"], 16) == b.encode_batch(["left of"], 16)
    assert (b.pad_id, b.mask_id) == (0, 4)


def test_load_errors_say_what_to_do(tmp_path):
    with pytest.raises(UserError, match="tokenizer train"):
        load_tokenizer("")
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="not a tokenizers JSON"):
        load_tokenizer(str(tmp_path / "bad.json"))


def test_foreign_tokenizer_special_ids_are_found_by_name(tmp_path):
    """A RoBERTa-style tokenizer.json: <s> </s> <pad> <mask>, padding declared in the file."""
    tok = tiny_tokenizer(tmp_path, "bpe")
    spec = json.loads(tok.hf.to_str())
    names = {"[PAD]": "<pad>", "[CLS]": "<s>", "[SEP]": "</s>", "[MASK]": "<mask>"}
    for t in spec["added_tokens"]:
        t["content"] = names.get(t["content"], t["content"])
    vocab = spec["model"]["vocab"]
    for old, new in names.items():
        vocab[new] = vocab.pop(old)
    spec["post_processor"] = None
    (tmp_path / "foreign.json").write_text(json.dumps(spec))
    other = load_tokenizer(str(tmp_path / "foreign.json"))
    assert (other.pad_id, other.cls_id, other.eos_id, other.mask_id) == (0, 2, 3, 4)
    spec["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 1, "pad_type_id": 0, "pad_token": "[UNK]"}
    (tmp_path / "padded.json").write_text(json.dumps(spec))
    padded = load_tokenizer(str(tmp_path / "padded.json"))
    assert padded.pad_id == 1
    short, long = padded.encode_batch(["red", "red circle left"], 64)
    assert len(short) < len(long)  # the file's padding is not applied: the collator pads


def test_tokenizer_train_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "m.jsonl", [{"text": f"a red circle number {i}"} for i in range(50)])
    r = run_cli(capsys, "tokenizer", "train", "m.jsonl", "--out", "tok.json", "--vocab-size", "300", "--kind", "wordpiece")
    assert r[0] == 0, r[2]
    tok = load_tokenizer(str(tmp_path / "tok.json"))
    assert tok.mask_id == 4 and tok.vocab_size <= 300
    r = run_cli(capsys, "tokenizer", "train", "missing.jsonl", "--out", "t.json")
    assert r[0] != 0 and "manifest not found" in r[2] and "Traceback" not in r[2]
