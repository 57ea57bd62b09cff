"""Regenerate the committed tiny assets: recipes/data/tiny/{short,medium,long}.jsonl and
hf_zero/data/tiny_assets/tiny_tokenizer.

    python hf_zero/data/tiny_assets/make_tiny_assets.py

The texts are templated English about numbers, colours and animals, drawn from a seeded RNG, so a run reproduces the
committed files. Tests and the tiny 3-stage curriculum use them to train in seconds without any download.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DATA_DIR = REPO / "recipes" / "data" / "tiny"
TOKENIZER_DIR = Path(__file__).resolve().parent / "tiny_tokenizer"
RECORDS_PER_FILE = 200
VOCAB_SIZE = 512
EOS, PAD = "<|endoftext|>", "<pad>"

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "brown", "grey", "orange", "purple"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "mouse", "rabbit", "duck", "bear", "goat", "frog", "sheep", "hen",
           "squirrel", "badger", "donkey", "turtle", "wolf", "pig", "swan"]
SIZES = ["big", "small", "old", "young", "happy", "sleepy", "quiet", "clever"]
PLACES = ["in the garden", "by the river", "on the hill", "under the old tree", "near the barn", "in the forest"]
VERBS = ["sees", "follows", "watches", "finds", "chases", "greets"]
TIMES = ["In the morning", "At noon", "In the evening", "At night", "After the rain", "On Sunday"]
DOINGS = ["sleeps", "runs", "sings", "eats", "hides", "plays", "waits"]


def _plural(animal: str, n: int) -> str:
    if n == 1:
        return animal
    return {"mouse": "mice", "sheep": "sheep", "fox": "foxes", "wolf": "wolves"}.get(animal, animal + "s")


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(6)
    a, b = rng.sample(ANIMALS, 2)
    c1, c2 = rng.choice(COLOURS), rng.choice(COLOURS)
    if kind == 0:  # arithmetic gives a tiny model something it can actually learn
        x, y = rng.randrange(7), rng.randrange(6)
        return f"{NUMBERS[x].capitalize()} plus {NUMBERS[y]} is {NUMBERS[x + y]}."
    if kind == 1:
        n = rng.randrange(1, 13)
        return f"There {'is' if n == 1 else 'are'} {NUMBERS[n]} {c1} {_plural(a, n)} {rng.choice(PLACES)}."
    if kind == 2:
        return f"The {c1} {a} {rng.choice(VERBS)} the {c2} {b}."
    if kind == 5:
        return f"The {rng.choice(SIZES)} {a} is {c1}, and the {rng.choice(SIZES)} {b} is {c2}."
    if kind == 3:
        return f"{rng.choice(TIMES)}, the {a} {rng.choice(DOINGS)} {rng.choice(PLACES)}."
    n = rng.randrange(2, 13)
    return f"The {a} counts {NUMBERS[n]} {c1} {_plural(b, n)} and then {rng.choice(DOINGS)}."


def _records(rng: random.Random, low: int, high: int, min_chars: int = 0, max_chars: int = 10**9) -> list[str]:
    texts, seen = [], set()
    while len(texts) < RECORDS_PER_FILE:
        parts = [_sentence(rng) for _ in range(rng.randint(low, high))]
        while len(" ".join(parts)) < min_chars:
            parts.append(_sentence(rng))
        text = " ".join(parts)
        if text not in seen and len(text) <= max_chars:  # unique records, so a held-out split never leaks
            seen.add(text)
            texts.append(text)
    return texts


def make_data() -> dict[str, list[str]]:
    rng = random.Random(20261122)
    data = {"short": _records(rng, 1, 1), "medium": _records(rng, 2, 3), "long": _records(rng, 5, 8, 300, 500)}
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for name, texts in data.items():
        with open(DATA_DIR / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return data


def make_tokenizer(texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # The full byte alphabet keeps any input encodable (no unknown tokens), whatever the training text covered.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=PAD,
                                   model_max_length=512)  # tiny-llama's max_position_embeddings
    fast.save_pretrained(TOKENIZER_DIR)


def main() -> None:
    data = make_data()
    make_tokenizer([t for texts in data.values() for t in texts])
    for name, texts in data.items():
        print(f"{DATA_DIR / name}.jsonl: {len(texts)} records, {sum(map(len, texts)) / len(texts):.0f} chars avg")
    print(f"{TOKENIZER_DIR}: vocab {VOCAB_SIZE}")


if __name__ == "__main__":
    main()
