"""Caption metrics against the package the field reports with: BLEU and CIDEr-D equal pycocoevalcap's
on hand-written and random sets, the PTB tokenizer equals its Java original, a malformed set is named."""

from __future__ import annotations

import random
import shutil

import pytest

from vltrain.errors import DataError
from vltrain.eval.caption_metrics import bleu, caption_scores, cider_d, ptb_tokenize

REFERENCES = {
    "kitchen": ["a kitchen with wooden cabinets and a white stove", "a small kitchen with a stove and an oven",
                "wooden cabinets line the walls of a kitchen", "a kitchen that has a stove and wooden cabinets",
                "an old kitchen with brown cabinets and a stove"],
    "surf": ["a man riding a wave on top of a surfboard", "a surfer rides a large wave in the ocean",
             "a person on a surfboard riding a wave", "a man surfing on a big blue wave",
             "a surfer in a black wetsuit riding a wave"],
    "dogs": ["two dogs playing with a frisbee in the park", "two dogs run after a red frisbee on the grass",
             "a pair of dogs playing in a grassy park", "two brown dogs chase a frisbee",
             "dogs play with a toy in a field"],
    "bus": ["a red double decker bus driving down a street", "a double decker bus on a city street",
            "a red bus is parked by the side of the road", "a tour bus driving past tall buildings",
            "a big red bus with two floors on the road"],
}
CANDIDATE_SETS = {
    "good": {"kitchen": "a kitchen with wooden cabinets and a stove", "surf": "a man riding a wave on a surfboard",
             "dogs": "two dogs playing with a frisbee", "bus": "a red double decker bus on a street"},
    "bad": {"kitchen": "a cat sleeping on a sofa", "surf": "a plate of food on a table",
            "dogs": "a man riding a wave", "bus": "two dogs in a park"},
    "empty candidate": {"kitchen": "", "surf": "a man riding a wave", "dogs": "dogs", "bus": "a bus"},
    "longer than every reference": {
        "kitchen": "a very old kitchen with many wooden cabinets and a white stove and an oven and a sink by a window",
        "surf": "a surfer", "dogs": "two dogs playing with a red frisbee in a grassy park on a sunny day today",
        "bus": "a red double decker bus driving down a city street past tall buildings with people on it"},
    "a subset of the images": {"surf": "a surfer riding a wave", "bus": "a red bus on a street"},
    "one image": {"dogs": "two dogs chase a frisbee"},
}


def pycocoevalcap_scores(references, candidates) -> tuple[list[float], float, list[float]]:
    """BLEU-1..4, CIDEr-D and its per-image scores as pycocoevalcap gives them on the candidates' images."""
    pytest.importorskip("pycocoevalcap")
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    gts = {key: list(references[key]) for key in candidates}
    res = {key: [caption] for key, caption in candidates.items()}
    bleus, _ = Bleu(4).compute_score(gts, res, verbose=0)
    cider, per_image = Cider().compute_score(gts, res)
    return bleus, float(cider), [float(s) for s in per_image]


def assert_as_pycocoevalcap(references, candidates, where: str = "") -> None:
    their_bleu, their_cider, their_per_image = pycocoevalcap_scores(references, candidates)
    corpus, per_image = cider_d(references, candidates)
    assert bleu(references, candidates) == pytest.approx(their_bleu, abs=1e-6, rel=0), where
    assert corpus == pytest.approx(their_cider, abs=1e-6, rel=0), where
    assert per_image == pytest.approx(their_per_image, abs=1e-6, rel=0), where


@pytest.mark.parametrize("name", CANDIDATE_SETS)
def test_hand_written_sets_score_as_pycocoevalcap(name):
    assert_as_pycocoevalcap(REFERENCES, CANDIDATE_SETS[name])


def test_the_hand_written_sets_are_not_trivial():
    """The sets above reach the cases they are for: every n-gram order matched, a brevity penalty,
    a length penalty, a zero."""
    assert bleu(REFERENCES, CANDIDATE_SETS["good"])[3] > 0.3
    assert bleu(REFERENCES, CANDIDATE_SETS["bad"])[3] < 1e-3
    assert 0 < bleu(REFERENCES, CANDIDATE_SETS["empty candidate"])[0] < 0.1
    _, per_image = cider_d(REFERENCES, CANDIDATE_SETS["empty candidate"])
    assert per_image[0] == 0.0
    assert cider_d(REFERENCES, CANDIDATE_SETS["one image"]) == (0.0, [0.0])  # log(1 image) weighs every n-gram 0


def random_set(rng: random.Random) -> tuple[dict[int, list[str]], dict[int, str]]:
    """A few images with 1-5 references from a vocabulary of 6 words (so 3- and 4-grams match often),
    candidates of 0-14 words, sometimes a reference's copy. A reference may be empty, but not all of
    an image's: pycocoevalcap fails on a set without a single reference n-gram."""
    vocabulary = ["a", "the", "dog", "red", "on", "man"]
    caption = lambda low, high: " ".join(rng.choice(vocabulary) for _ in range(rng.randint(low, high)))
    references = {image: [caption(1, 12)] + [caption(0, 12) for _ in range(rng.randint(0, 4))]
                  for image in range(rng.randint(1, 6))}
    candidates = {image: rng.choice(refs) if rng.random() < 0.15 else caption(0, 14)
                  for image, refs in references.items()}
    return references, candidates


def test_random_sets_score_as_pycocoevalcap():
    rng = random.Random(20240607)
    for i in range(300):
        references, candidates = random_set(rng)
        assert_as_pycocoevalcap(references, candidates, where=f"random set {i}: {references} {candidates}")


def test_a_perfect_candidate_scores_higher_than_a_wrong_one():
    references = {"kitchen": ["A kitchen with wooden cabinets, and a stove.", "A small kitchen (with an oven)."],
                  "surf": ["A man's riding a wave on top of a surfboard.", "A surfer rides a large wave."],
                  "dogs": ["Two dogs don't stop playing with a frisbee!", "Two dogs chase a red frisbee."]}
    perfect = {key: refs[0] for key, refs in references.items()}
    wrong = {"kitchen": "A plate of food.", "surf": "Two dogs in a park.", "dogs": "A red bus on a street."}
    best, worst = caption_scores(references, perfect), caption_scores(references, wrong)
    assert best["bleu1"] == pytest.approx(1.0) and best["bleu4"] == pytest.approx(1.0)
    assert best["bleu4"] > worst["bleu4"] and best["bleu1"] > worst["bleu1"] and best["cider"] > worst["cider"] > -1e-12


def test_a_candidate_without_references_is_named():
    with pytest.raises(DataError, match=r"image 'boat'.* not among the references' keys") as error:
        caption_scores(REFERENCES, {"surf": "a surfer", "boat": "a boat on a lake"})
    assert "\n" not in str(error.value)
    with pytest.raises(DataError, match="image 7"):
        bleu({1: ["a dog"]}, {7: "a dog"})


def test_an_image_with_no_reference_is_named():
    with pytest.raises(DataError, match=r"image 'bus' has no reference captions") as error:
        cider_d({**REFERENCES, "bus": []}, {"surf": "a surfer"})
    assert "\n" not in str(error.value)
    with pytest.raises(DataError, match="no candidate captions"):
        caption_scores(REFERENCES, {})


KNOWN_TOKENIZATIONS = [
    ("A man's dog (brown) doesn't \"like\" the cat.", "a man 's dog -lrb- brown -rrb- does n't like the cat"),
    ("He can't go... cannot, gonna!", "he ca n't go can not gon na"),
    ("A black-and-white photo of AT&T, 1,000 3.5 $5 & a/b.", "a black-and-white photo of at&t 1,000 3.5 $ 5 & a/b"),
    ("The U.S. flag, etc. and Mr. Smith's 1 1/2 cups.", "the u.s. flag etc. and mr. smith 's 1\u00a01/2 cups"),
    ("A [red] {blue} sign -- \u201cSTOP\u201d \u2014 rock 'n' roll ?!",
     "a -lsb- red -rsb- -lcb- blue -rcb- sign stop rock 'n' roll ?!"),
]


@pytest.mark.parametrize(("caption", "tokens"), KNOWN_TOKENIZATIONS)
def test_ptb_tokenize_known_cases(caption, tokens):
    """Checked once against the Java tokenizer; pinned here for machines without Java."""
    assert ptb_tokenize(caption) == tokens


COCO_STYLE_CAPTIONS = [
    "A man riding a wave on top of a surfboard.",
    "Two dogs playing with a frisbee in the park, near a tree.",
    "A kitchen with wooden cabinets and a stove/oven.",
    "The man's bike is leaning against a red-brick wall.",
    "A woman doesn't want to eat her sandwich.",
    "A cat that's sitting on a laptop's keyboard.",
    "A bus that says \"Downtown\" on the front.",
    "A sign reading 'No Parking' next to a fire hydrant.",
    "A plate of food (eggs, bacon, and toast) on a table.",
    "Two giraffes standing next to each other in a zoo.",
    "A 12-year-old boy swings a baseball bat.",
    "A black and white photo of a train at a station.",
    "Salt & pepper shakers sit next to a pizza.",
    "A man in a t-shirt and jeans is holding an umbrella.",
    "There are 3 elephants walking in the grass.",
    "The clock reads 10:30 on the tower.",
    "A little girl's birthday cake with 5 candles on it.",
    "People are waiting for the No. 7 bus.",
    "A living room with a couch, a TV, and a coffee table.",
    "A stop sign that has been vandalized with graffiti!",
    "Is this a picture of a dog or a cat?",
    "A man wearing a hat and sunglasses; he's smiling.",
    "Someone is cutting a cake -- with a knife.",
    "A 1950's style diner with red booths.",
    "Two men play frisbee at the beach in the '90s.",
    "Mr. Smith's car is parked on the street.",
    "A bathroom with a toilet, sink and mirror...",
    "A bowl of fruit: apples, oranges, and bananas.",
    "An airplane flying over the U.S. Capitol building.",
    "A hot dog with ketchup/mustard on a bun.",
    "A skateboarder does a trick on a half-pipe.",
    "They're eating pizza at a table.",
    "We'll see a cow standing in a field.",
    "A man holding a sign that says \"I'm hungry\".",
    "A teddy bear sitting on a bed (with pillows).",
    "A baseball player swings at a pitch; the catcher waits.",
    "A bike parked outside a store called Joe's Bikes & More.",
    "The 2 kids won't stop playing video games.",
    "A zebra grazing in the tall grass, etc.",
    "A double-decker bus on a London street.",
    "A WOMAN HOLDING AN UMBRELLA IN THE RAIN.",
    "a dog laying on a couch next to a remote",
    "  A vase with flowers on a table  ",
    "A sign for the 24/7 store, $3.99 per gallon.",
    "Two people ride horses at 5 p.m. on a trail.",
    "A man's hand holding a cell phone - an iPhone.",
    "A small dog wearing a pink sweater...",
    "An old-fashioned clock that reads 3:45.",
]


@pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap's PTB tokenizer runs Java")
def test_ptb_tokenize_equals_pycocoevalcaps_java_tokenizer():
    pytest.importorskip("pycocoevalcap")
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    theirs = PTBTokenizer().tokenize({i: [{"caption": c}] for i, c in enumerate(COCO_STYLE_CAPTIONS)})
    ours = {i: [ptb_tokenize(c)] for i, c in enumerate(COCO_STYLE_CAPTIONS)}
    assert ours == theirs


@pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap's PTB tokenizer runs Java")
def test_caption_scores_equal_pycocoevalcaps_pipeline():
    """Raw captions in, the numbers the COCO caption evaluation prints out."""
    pytest.importorskip("pycocoevalcap")
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    references = {i: COCO_STYLE_CAPTIONS[5 * i:5 * i + 5] for i in range(8)}
    candidates = {i: COCO_STYLE_CAPTIONS[(5 * i + 7) % 40] for i in range(8)}
    candidates[0] = references[0][2]
    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": c} for c in refs] for i, refs in references.items()})
    res = tokenizer.tokenize({i: [{"caption": c}] for i, c in candidates.items()})
    their_bleu, their_cider, _ = pycocoevalcap_scores(gts, {i: caps[0] for i, caps in res.items()})
    ours = caption_scores(references, candidates)
    assert ours == pytest.approx({"bleu1": their_bleu[0], "bleu4": their_bleu[3], "cider": their_cider},
                                 abs=1e-6, rel=0)
