"""Pure text-cleaning steps of `prepare_data`: normalisation, exact and near deduplication, split.

Every function here is deterministic (same input, same output, on any machine and Python run:
no salted `hash()`), depends on the standard library and numpy only, and touches no files::

    from pipelines.core import cleaning
    cleaning.normalize_text("Caf\\u00e9\\t menu \\r\\n", "NFKC")   # -> "Café menu"
    cleaning.near_duplicates(texts, threshold=0.9)              # -> bool array, True = drop
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np

# Line breaks other than "\n" (Windows/Mac endings, vertical tab, form feed, NEL, Unicode line and
# paragraph separators) all become "\n", so that "whitespace except newline" below is only spaces.
_LINE_BREAKS = re.compile("\r\n|[\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
# Runs of whitespace other than newline that are not already one plain space (replacing every
# single space by itself was most of the normalisation time).
_SPACES = re.compile(r"[^\S\n]{2,}|[^\S\n ]")
_ANY_LINE_BREAK = re.compile("[\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
# Every character `str.isspace` (and so regex `\s`) accepts but " " and "\n"; tests/core/data/test_cleaning.py checks the list.
OTHER_SPACES = "\t\v\f\r\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
_OTHER_SPACE = re.compile(f"[{OTHER_SPACES}]")
_TRAILING_SPACE = re.compile(r" +\n")
_BLANK_RUNS = re.compile(r"\n{3,}")

_MASK64 = (1 << 64) - 1
# Probability that a pair exactly at the threshold lands in at least one shared LSH bucket; the
# banding picks the fewest candidates (most rows per band) that still reaches it. Candidates are
# confirmed afterwards, so a generous banding costs only time, never precision.
_MIN_RECALL_AT_THRESHOLD = 0.95
# Above this size a bucket is compared star-wise (every member against its first) rather than
# pairwise, so a pathological bucket cannot make the pair count quadratic.
_MAX_PAIRWISE_BUCKET = 256
# Shingles hashed at a time by `minhash_signatures` (a few hundred KiB per array).
_BLOCK = 1 << 15


# ------------------------------------------------------------------------------- normalisation


def normalize_text(text: str, form: str) -> str:
    """Normalise one string.

    Steps, in order:

    1. Unicode normalisation `form` (NFKC, NFC, ...) unless `form == "none"`.
    2. `\\r\\n`, `\\r` and the other line breaks (`\\v`, `\\f`, `\\x1c`-`\\x1e`, `\\x85`,
       U+2028, U+2029) become `\\n`.
    3. Every run of other whitespace (spaces, tabs, no-break and other Unicode spaces) becomes
       one space.
    4. Spaces at the end of each line are removed.
    5. Three or more consecutive newlines become two (at most one blank line).
    6. Leading and trailing whitespace is removed.

    Args:
        text: the string to normalise.
        form: a `unicodedata` form ("NFKC", "NFC", "NFD", "NFKD") or "none".

    Returns:
        The normalised string.
    """
    if form != "none":
        text = unicodedata.normalize(form, text)
    # Each substitution only where it has something to do: the checks are several times faster.
    if _ANY_LINE_BREAK.search(text):
        text = _LINE_BREAKS.sub("\n", text)
    if "  " in text or _OTHER_SPACE.search(text):
        text = _SPACES.sub(" ", text)
    if " \n" in text:
        text = _TRAILING_SPACE.sub("\n", text)
    if "\n\n\n" in text:
        text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip()


# ------------------------------------------------------------------------------------- hashing


def _sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def exact_duplicates(keys: Iterable[str]) -> np.ndarray:
    """Flag repeated keys: True for every occurrence after the first (by SHA-256 of the key).

    Args:
        keys: one string per record (e.g. its normalised content).

    Returns:
        A bool array, one entry per key; the first occurrence of each key is False.
    """
    seen: set[bytes] = set()
    flags = []
    for key in keys:
        digest = _sha256(key)
        flags.append(digest in seen)
        seen.add(digest)
    return np.asarray(flags, dtype=bool)


def assign_split(keys: Iterable[str], validation_fraction: float, seed: int) -> list[str]:
    """Assign each key to "train" or "validation", stably and independently of order.

    The first 8 bytes of SHA-256(f"{seed}:{key}"), read as a big-endian integer and divided by
    2**64, give a number u in [0, 1); the key goes to "validation" when u < validation_fraction.

    Args:
        keys: one string per record (e.g. its normalised content).
        validation_fraction: expected share of "validation" (0 sends everything to "train").
        seed: salt; another seed gives another, equally stable, split.

    Returns:
        One split name per key.
    """
    out = []
    for key in keys:
        unit = int.from_bytes(_sha256(f"{seed}:{key}")[:8], "big") / 2**64
        out.append("validation" if unit < validation_fraction else "train")
    return out


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array: a fast bijection that scrambles every bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")


# Word hashes seen in this process, so a corpus hashes each distinct word once (bounded: cleared
# when full). Only a speed-up: a word's hash is the same with or without it.
_WORD_HASHES: dict[str, int] = {}
_MAX_CACHED_WORDS = 2_000_000


def _hash_words(distinct: Iterable[str], count: int) -> np.ndarray:
    if len(_WORD_HASHES) > _MAX_CACHED_WORDS:
        _WORD_HASHES.clear()
    cache = _WORD_HASHES
    return np.fromiter((cache[w] if w in cache else cache.setdefault(w, _word_hash(w)) for w in distinct), dtype=np.uint64, count=count)


def _words(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The number of words of each text and every word's hash, in order. Words: Arrow's
    `utf8_lower` then `utf8_split_whitespace` (Unicode lower case and white space as utf8proc
    defines them: Python's `str.lower().split()` but for a few characters: Python lowers a
    word-final Σ to ς and also splits at \\x1c-\\x1f), computed in C++; each distinct word is hashed once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    split = pc.utf8_split_whitespace(pc.utf8_lower(pa.array(texts, pa.large_string())))
    values, owners = pc.list_flatten(split), pc.list_parent_indices(split)
    present = pc.not_equal(values, "")  # Arrow keeps "" around leading, trailing and repeated spaces
    values, owners = values.filter(present), owners.filter(present).to_numpy()
    lengths = np.bincount(owners, minlength=len(texts)).astype(np.int64)
    if not len(values):
        return lengths, np.zeros(0, dtype=np.uint64)
    encoded = values.dictionary_encode()
    distinct = encoded.dictionary.to_pylist()
    return lengths, _hash_words(distinct, len(distinct))[encoded.indices.to_numpy()]


# ------------------------------------------------------------------------------ near duplicates


def _shingle_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of each text's word 3-grams, concatenated, and each text's first offset."""
    lengths, words = _words(texts)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(texts) else np.zeros(0, dtype=np.int64)
    # A text of n >= 3 words has n - 2 shingles; a shorter one has one shingle of all its words.
    counts = np.maximum(lengths - 2, 1)
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(texts) else np.zeros(0, dtype=np.int64)
    owner = np.repeat(np.arange(len(texts)), counts)
    position = np.repeat(starts, counts) + (np.arange(counts.sum()) - np.repeat(offsets, counts))
    combined = np.zeros(len(owner), dtype=np.uint64)
    for k in range(3):
        # Chained mixing is order-sensitive ("a b c" and "c b a" differ); a word past the end of a
        # short text (n < 3) counts as 0.
        present = k < lengths[owner]
        value = words[np.where(present, position + k, 0)] if words.size else np.zeros(len(owner), dtype=np.uint64)
        combined = _mix64((combined + np.uint64(0x9E3779B97F4A7C15)) ^ np.where(present, value, np.uint64(0)))
    return combined, offsets


def _mix64_into(x: np.ndarray, scratch: np.ndarray) -> None:
    """`_mix64` in place (`scratch`: an array of the same shape), without temporaries."""
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
        np.right_shift(x, np.uint64(shift), out=scratch)
        np.bitwise_xor(x, scratch, out=x)
        if factor is not None:
            np.multiply(x, np.uint64(factor), out=x)


def minhash_signatures(texts: Sequence[str], num_perm: int = 64, seed: int = 0) -> np.ndarray:
    """MinHash signatures over lower-cased, whitespace-split word 3-grams.

    Each shingle is hashed to 64 bits (BLAKE2b of each word, combined with SplitMix64); column j
    of the signature is the minimum over the text's shingles of SplitMix64(shingle ^ salt_j),
    with `num_perm` salts drawn from `numpy.random.default_rng(seed)`.

    Args:
        texts: the documents.
        num_perm: signature length (number of hash functions).
        seed: seed of the salts.

    Returns:
        A `(len(texts), num_perm)` uint64 array.
    """
    if not len(texts):
        return np.zeros((0, num_perm), dtype=np.uint64)
    shingles, offsets = _shingle_hashes(texts)
    salts = np.random.default_rng(seed).integers(0, _MASK64, size=num_perm, dtype=np.uint64, endpoint=True)
    signatures = np.empty((len(texts), num_perm), dtype=np.uint64)
    # Whole texts at a time, about _BLOCK shingles: the salted copies stay in the CPU cache.
    ends = np.append(offsets[1:], len(shingles))
    first = 0
    while first < len(texts):
        last = max(first + 1, int(np.searchsorted(ends, offsets[first] + _BLOCK, side="right")))
        block = shingles[offsets[first] : ends[last - 1]]
        starts = offsets[first:last] - offsets[first]
        x, scratch = np.empty_like(block), np.empty_like(block)
        for j, salt in enumerate(salts):
            np.bitwise_xor(block, salt, out=x)
            _mix64_into(x, scratch)
            signatures[first:last, j] = np.minimum.reduceat(x, starts)
        first = last
    return signatures


def lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """Choose LSH banding `(bands, rows)` with `bands * rows == num_perm` for a threshold.

    A pair with Jaccard similarity s shares at least one band with probability
    1 - (1 - s**rows)**bands. The choice is the largest `rows` (fewest candidates) for which that
    probability at s = threshold is at least 0.95; `rows = 1` if none reaches it.
    E.g. num_perm 64: threshold 0.9 -> (8, 8); 0.8 -> (16, 4); 0.5 -> (32, 2).
    """
    for rows in sorted((r for r in range(1, num_perm + 1) if num_perm % r == 0), reverse=True):
        bands = num_perm // rows
        if 1 - (1 - threshold**rows) ** bands >= _MIN_RECALL_AT_THRESHOLD:
            return bands, rows
    return num_perm, 1


def _band_pairs(band_keys: np.ndarray) -> np.ndarray:
    """Index pairs (i < j) of rows that share a band key, as an (n, 2) array (may repeat)."""
    order = np.argsort(band_keys, kind="stable")
    sorted_keys = band_keys[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_keys[1:] != sorted_keys[:-1])))
    sizes = np.diff(np.append(starts, len(order)))
    pairs = []
    for start, size in zip(starts[sizes > 1].tolist(), sizes[sizes > 1].tolist(), strict=True):
        group = np.sort(order[start : start + size])
        if size > _MAX_PAIRWISE_BUCKET:
            pairs.append(np.column_stack((np.full(size - 1, group[0]), group[1:])))
        else:
            i, j = np.triu_indices(size, k=1)
            pairs.append(np.column_stack((group[i], group[j])))
    return np.concatenate(pairs) if pairs else np.zeros((0, 2), dtype=np.int64)


def _first_of_groups(n: int, pairs: np.ndarray) -> np.ndarray:
    """Union the pairs into groups; True for every member except each group's lowest index."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs.tolist():
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return np.fromiter((find(i) != i for i in range(n)), dtype=bool, count=n)


def near_duplicates(texts: Sequence[str], threshold: float, num_perm: int = 64, seed: int = 0) -> np.ndarray:
    """Flag near-duplicate texts: True for every member of a similar group except its first.

    Algorithm:

    1. Shingles: the set of word 3-grams of the lower-cased, whitespace-split text (`_words`); a text of fewer than three
       words has one shingle made of all its words.
    2. MinHash signatures of `num_perm` values (`minhash_signatures`, seeded by `seed`).
    3. LSH: the signature is cut into `bands` bands of `rows` values (`lsh_bands(threshold)`);
       texts whose signatures agree on a whole band are candidate pairs (texts with identical
       signatures always are).
    4. A candidate pair is confirmed when the estimated Jaccard similarity, the share of equal
       signature values, is >= `threshold`.
    5. Confirmed pairs are joined into groups (connected components); the lowest index of each
       group is kept, every other member is flagged.

    With word 3-grams, changing one word in the middle of an n-word text leaves Jaccard
    (n - 5) / (n + 1): 0.88 for 50 words, so thresholds near 0.9 catch only edits near the ends.

    Args:
        texts: the documents, in priority order (earlier ones are kept).
        threshold: estimated Jaccard similarity at or above which two texts are near duplicates.
        num_perm: MinHash signature length (a multiple with many divisors, e.g. 64 or 128).
        seed: seed of the MinHash functions.

    Returns:
        A bool array, one entry per text.
    """
    n = len(texts)
    if n < 2:
        return np.zeros(n, dtype=bool)
    signatures = minhash_signatures(texts, num_perm, seed)
    keys = band_keys(signatures, threshold)
    candidates = np.unique(np.concatenate([_band_pairs(keys[:, band]) for band in range(keys.shape[1])]), axis=0)
    return flag_groups(n, confirm_pairs(candidates, signatures, threshold))


def band_keys(signatures: np.ndarray, threshold: float) -> np.ndarray:
    """The LSH key of each band of each signature (`lsh_bands(threshold)`): `(n, bands)` uint64.
    Two texts are candidates when they share the key of one band (the same column)."""
    bands, rows = lsh_bands(threshold, signatures.shape[1])
    keys = np.zeros((len(signatures), bands), dtype=np.uint64)
    for band in range(bands):
        for column in signatures[:, band * rows : (band + 1) * rows].T:
            keys[:, band] = _mix64(keys[:, band] ^ column)
    return keys


def band_pairs(band_keys: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Candidate pairs among the texts `indices` (ascending) whose keys of one band are
    `band_keys`: `(m, 2)` pairs of their indices, lower first (may repeat)."""
    pairs = _band_pairs(band_keys)
    return indices[pairs] if len(pairs) else pairs


def confirm_pairs(candidates: np.ndarray, signatures, threshold: float, first: int = 0) -> np.ndarray:
    """The candidate pairs whose estimated Jaccard similarity (the share of equal signature
    values; `signatures` may be a memory map whose row 0 is text `first`) is >= `threshold`."""
    if not len(candidates):
        return candidates.reshape(0, 2)
    similarity = (signatures[candidates[:, 0] - first] == signatures[candidates[:, 1] - first]).mean(axis=1)
    return candidates[similarity >= threshold]


def flag_groups(n: int, pairs: np.ndarray) -> np.ndarray:
    """Join `pairs` of text indices (< `n`) into groups: True for every member but each group's lowest."""
    flags = np.zeros(n, dtype=bool)
    if len(pairs):
        nodes = np.unique(pairs)  # only texts in a pair can be flagged: union-find over those
        flags[nodes[_first_of_groups(len(nodes), np.searchsorted(nodes, pairs))]] = True
    return flags
