"""Unit tests of pipelines/core/data/cleaning.py: normalisation, exact and near dedup, split assignment."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipelines.core.data import cleaning

# ------------------------------------------------------------------------------ normalize_text


@pytest.mark.parametrize(
    ("raw", "form", "expected"),
    [
        ("  hello   world  ", "NFKC", "hello world"),
        ("a\r\nb\rc", "NFKC", "a\nb\nc"),
        ("tab\there\u00a0and\u2003em", "none", "tab here and em"),  # tabs and Unicode spaces -> space
        ("line one   \nline two\t\n", "NFKC", "line one\nline two"),  # trailing spaces per line
        ("a\n\n\n\n\nb", "NFKC", "a\n\nb"),  # 3+ newlines -> 2
        ("a\n  \n \t \nb", "NFKC", "a\n\nb"),  # whitespace-only lines count as blank
        ("a\n\nb", "NFKC", "a\n\nb"),  # one blank line is kept
        ("\ufb01ne \u2460", "NFKC", "fine 1"),  # NFKC folds the ligature and the circled digit
        ("\ufb01ne", "NFC", "\ufb01ne"),  # NFC keeps compatibility characters
        ("e\u0301", "NFC", "\u00e9"),  # NFC composes
        ("e\u0301", "none", "e\u0301"),  # none leaves code points alone
        ("a\u2028b\fc", "none", "a\nb\nc"),  # other line breaks -> \n
        ("  \n\t\n ", "NFKC", ""),
    ],
)
def test_normalize_text(raw, form, expected):
    assert cleaning.normalize_text(raw, form) == expected


def test_normalize_text_is_idempotent():
    raw = " Caf\u00e9\t\tmenu \r\n\r\n\r\n\u00a0x  \n"
    once = cleaning.normalize_text(raw, "NFKC")
    assert once == "Café menu\n\n x"
    assert cleaning.normalize_text(once, "NFKC") == once


# --------------------------------------------------------------------------- exact_duplicates


def test_exact_duplicates_flags_every_later_occurrence():
    flags = cleaning.exact_duplicates(["a", "b", "a", "c", "b", "a", "A"])
    assert flags.dtype == bool
    assert flags.tolist() == [False, False, True, False, True, True, False]


def test_exact_duplicates_empty_input():
    assert cleaning.exact_duplicates([]).shape == (0,)


# ---------------------------------------------------------------------------- near_duplicates


def _random_texts(n: int, words: int = 50, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(20_000)])
    return [" ".join(rng.choice(vocab, words)) for _ in range(n)]


def test_lsh_bands_multiply_to_num_perm_and_reach_recall_at_threshold():
    # threshold 0.9 with 8 rows x 8 bands: 1 - (1 - 0.9**8)**8 = 0.989 >= 0.95, while 16 rows
    # x 4 bands gives only 1 - (1 - 0.9**16)**4 = 0.56.
    assert cleaning.lsh_bands(0.9, 64) == (8, 8)
    assert cleaning.lsh_bands(0.8, 64) == (16, 4)
    assert cleaning.lsh_bands(0.5, 64) == (32, 2)
    assert cleaning.lsh_bands(1.0, 64) == (1, 64)
    for threshold in (0.3, 0.6, 0.75, 0.95):
        bands, rows = cleaning.lsh_bands(threshold, 128)
        assert bands * rows == 128
        assert 1 - (1 - threshold**rows) ** bands >= 0.95


def test_near_duplicates_catches_one_changed_word():
    base = _random_texts(1, seed=1)[0].split()
    middle = list(base)
    middle[25] = "changed"  # 3 of 48 shingles differ: Jaccard 45/51 = 0.88
    end = list(base)
    end[-1] = "changed"  # 1 of 48 shingles differs: Jaccard 47/49 = 0.96
    others = _random_texts(20, seed=2)
    texts = [" ".join(base), *others[:10], " ".join(middle), *others[10:], " ".join(end)]
    flags = cleaning.near_duplicates(texts, threshold=0.8)
    assert np.flatnonzero(flags).tolist() == [11, 22]  # the edits; the original (index 0) is kept
    # At 0.9 the change at the end is still caught; 0.88 of the middle edit is below it.
    assert cleaning.near_duplicates(texts, threshold=0.9)[22]


def test_near_duplicates_keeps_different_texts():
    texts = _random_texts(500, seed=3)
    assert not cleaning.near_duplicates(texts, threshold=0.5).any()


def test_near_duplicates_groups_keep_only_the_first():
    a = _random_texts(1, seed=4)[0]
    texts = ["unrelated words in a short sentence here", a, a.upper(), a, "another short unrelated sentence ok"]
    # Shingles are lower-cased, so a.upper() is the same text as a.
    assert cleaning.near_duplicates(texts, threshold=0.9).tolist() == [False, False, True, True, False]


def test_near_duplicates_short_texts_use_one_shingle():
    texts = ["hello world", "hello world", "world hello", "hi", "hi", ""]
    # Fewer than 3 words: one shingle of all the words, in order.
    assert cleaning.near_duplicates(texts, threshold=0.9).tolist() == [False, True, False, False, True, False]


def test_near_duplicates_is_deterministic_and_seeded():
    texts = _random_texts(200, seed=5)
    texts += [t + " extra" for t in texts[:50]]
    first = cleaning.near_duplicates(texts, threshold=0.8)
    assert first.tolist() == cleaning.near_duplicates(list(texts), threshold=0.8).tolist()
    assert first.sum() == 50 and not first[:200].any()
    signatures = cleaning.minhash_signatures(texts[:3], num_perm=16, seed=0)
    assert signatures.shape == (3, 16) and signatures.dtype == np.uint64
    assert (signatures == cleaning.minhash_signatures(texts[:3], num_perm=16, seed=0)).all()
    assert (signatures != cleaning.minhash_signatures(texts[:3], num_perm=16, seed=1)).any()


def test_near_duplicates_tiny_inputs():
    assert cleaning.near_duplicates([], 0.9).tolist() == []
    assert cleaning.near_duplicates(["only one"], 0.9).tolist() == [False]


def test_near_duplicates_fast_on_10k_documents():
    texts = _random_texts(10_000, seed=6)
    started = time.perf_counter()
    flags = cleaning.near_duplicates(texts, threshold=0.9)
    assert time.perf_counter() - started < 2.0
    assert not flags.any()


# ------------------------------------------------------------------------------- assign_split


def test_assign_split_is_stable_and_order_independent():
    keys = [f"record {i}" for i in range(1000)]
    splits = cleaning.assign_split(keys, 0.3, seed=7)
    assert set(splits) == {"train", "validation"}
    reversed_splits = cleaning.assign_split(keys[::-1], 0.3, seed=7)
    assert reversed_splits[::-1] == splits
    # Each key's split depends only on that key: a subset gets the same answers.
    assert cleaning.assign_split(keys[100:200], 0.3, seed=7) == splits[100:200]


def test_assign_split_fraction_over_10k_keys():
    keys = [f"key-{i}" for i in range(10_000)]
    share = cleaning.assign_split(keys, 0.05, seed=0).count("validation") / len(keys)
    # Binomial(10k, 0.05): standard deviation 0.0022, so 0.04..0.06 is > 4 sigma.
    assert 0.04 < share < 0.06


def test_assign_split_seed_and_extremes():
    keys = [f"key-{i}" for i in range(2000)]
    assert cleaning.assign_split(keys, 0.5, seed=0) != cleaning.assign_split(keys, 0.5, seed=1)
    assert set(cleaning.assign_split(keys, 0.0, seed=0)) == {"train"}


def test_assign_split_matches_the_documented_hash():
    import hashlib

    digest = hashlib.sha256(b"3:abc").digest()
    unit = int.from_bytes(digest[:8], "big") / 2**64
    assert cleaning.assign_split(["abc"], unit + 1e-9, seed=3) == ["validation"]
    assert cleaning.assign_split(["abc"], unit, seed=3) == ["train"]


def test_other_spaces_are_every_space_but_blank_and_newline():
    """normalize_text skips the space substitution when none of these is there: the list must be complete."""
    expected = "".join(chr(c) for c in range(0x110000) if chr(c).isspace() and chr(c) not in " \n")
    assert expected == cleaning.OTHER_SPACES


def test_normalize_text_equals_its_six_steps_on_random_strings():
    """The checks that skip a substitution change nothing: compare with the steps applied blindly."""
    import re
    import unicodedata

    def steps(text: str, form: str) -> str:
        text = unicodedata.normalize(form, text) if form != "none" else text
        text = re.sub("\r\n|[\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]", "\n", text)
        text = re.sub(r"[^\S\n]+", " ", text)
        text = re.sub(r" +\n", "\n", text)
        return re.sub(r"\n{3,}", "\n\n", text).strip()

    rng = np.random.default_rng(0)
    alphabet = list("ab .\n") + list(cleaning.OTHER_SPACES) + ["\r\n", "é", "ﬁ", "  ", "\n\n\n"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet, size=rng.integers(0, 30)))
        for form in ("NFKC", "none"):
            assert cleaning.normalize_text(text, form) == steps(text, form), repr(text)


def test_minhash_words_are_pythons_lower_split():
    """Words are split by Arrow in C++; on these texts they are Python's `text.lower().split()`
    (the known differences: a word-final Σ, and \\x1c-\\x1f as separators)."""
    texts = ["The Quick  brown\tfox", "  lead and trail  ", "", "Ünïcode WÖRDS\u3000here", "Café\u00a0au lait", "x\ny\n\nz", "Straße ΣΊΣΥΦΟΣ"]
    texts[-1] = texts[-1].replace("ΣΥΦΟΣ", "ΣΥΦΟ")  # not a final Σ: Python lowers it to ς, Arrow to σ
    lengths, words = cleaning._words(texts)
    expected = [w for t in texts for w in t.lower().split()]
    assert lengths.tolist() == [len(t.lower().split()) for t in texts]
    assert words.tolist() == [cleaning._word_hash(w) for w in expected]
