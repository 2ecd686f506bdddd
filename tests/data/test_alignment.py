"""Pairs never misalign: shuffled, two workers, every batch row is the source row with its id."""

import hashlib
import tempfile
from pathlib import Path

import pytest
import torch
from kits.datafiles import WORDS, distinct_image, save, tiny_tokenizer, write_csv, write_jsonl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, RandomSampler

from vltrain.data.config import DataConfig
from vltrain.data.dataset import build_dataset
from vltrain.data.ids import stable_uid
from vltrain.data.images import decode_image
from vltrain.data.loading.collate import Collator
from vltrain.data.sources.manifests import ManifestSource
from vltrain.data.sources.shards import write_shards

IMAGE_SIZE, MAX_LEN = 8, 24

row_strategy = st.fixed_dictionaries(
    {
        "modality": st.sampled_from(["image-text", "image-text", "text", "image"]),
        "words": st.lists(st.sampled_from(WORDS), min_size=1, max_size=12),
        "size": st.tuples(st.integers(3, 40), st.integers(3, 40)),
        "ext": st.sampled_from(["png", "jpg"]),
    }
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def write_source(folder: Path, fmt: str, rows: list[dict]) -> tuple[str, dict[int, dict]]:
    """Write ``rows`` as ``fmt``; return the source path and the expected row per uid."""
    expected, manifest = {}, []
    for i, r in enumerate(rows):
        rid = f"row-{i}-{r['size'][0]}"
        entry = {"id": rid}
        want = {"id": rid, "text": None, "pixels": None}
        if r["modality"] != "image":
            entry["text"] = want["text"] = " ".join(r["words"])
        if r["modality"] != "text":
            # Distinct pixels per row, so a hash tells rows apart (PNG: exactly, JPEG: nearly).
            path = save(distinct_image(i, r["size"]), folder / "img" / f"{i}.{r['ext']}")
            entry["image"] = f"img/{path.name}"
            want["pixels"] = hashlib.sha256(decode_image(path.read_bytes(), IMAGE_SIZE).numpy().tobytes()).hexdigest()
            want["red"] = i % 251 if r["ext"] == "png" else None
        manifest.append(entry)
        expected[stable_uid(rid)] = want
    jsonl = write_jsonl(folder / "m.jsonl", manifest)
    if fmt == "jsonl":
        return str(jsonl), expected
    if fmt == "csv":
        table = [[e["id"], e.get("image", ""), e.get("text", "")] for e in manifest]
        return str(write_csv(folder / "m.csv", ["id", "filepath", "title"], table)), expected
    written, _ = write_shards(ManifestSource(jsonl), folder / "shards", shard_size=5)
    return str(folder / "shards" / f"{{00000..{len(written) - 1:05d}}}.tar"), expected


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fmt=st.sampled_from(["jsonl", "csv", "shards"]),
    rows=st.lists(row_strategy, min_size=1, max_size=23),
    batch_size=st.integers(1, 6),
    seed=st.integers(0, 2**31),
)
def test_every_batch_row_is_the_source_row_with_its_id(tok, fmt, rows, batch_size, seed):
    with tempfile.TemporaryDirectory() as d:
        path, expected = write_source(Path(d), fmt, rows)
        cfg = DataConfig(train=path, image_size=IMAGE_SIZE, max_text_length=MAX_LEN)
        ds = build_dataset(cfg, "train", tok)
        loader = DataLoader(
            ds, batch_size=batch_size, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(seed)),
            num_workers=2, collate_fn=Collator(tok.pad_id, MAX_LEN, IMAGE_SIZE),
        )
        seen = []
        for batch in loader:
            assert batch.errors == []
            for r in range(len(batch)):
                uid = int(batch.ids[r])
                want = expected[uid]
                seen.append(uid)
                assert bool(batch.has_image[r]) == (want["pixels"] is not None)
                assert bool(batch.has_text[r]) == (want["text"] is not None)
                if want["pixels"] is not None:
                    pixels = batch.images.pixels[r]
                    assert hashlib.sha256(pixels.numpy().tobytes()).hexdigest() == want["pixels"]
                    assert want["red"] is None or int(pixels[0, 0, 0]) == want["red"]
                else:
                    assert not batch.images.pixels[r].any()
                ids = batch.input_ids[r][batch.attention_mask[r].bool()].tolist()
                if want["text"] is not None:
                    assert tok.decode(ids) == want["text"]
                else:
                    assert ids == []
        assert sorted(seen) == sorted(expected)
