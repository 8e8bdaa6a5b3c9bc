"""A deterministic synthetic world: invented people with four attributes, plus small-number sums.

The data is shaped so that a tiny model can show held-out gains after SFT: every fact, held-out or
not, is stated in the pretraining text (paraphrased bios, arithmetic sentences), while questions
about held-out people and sums never appear in training chats or preferences. Answering them means
extracting knowledge learnt in pretraining in the chat format learnt on the other facts.

    from pipelines.core.params.data import SampleDataParams
    from pipelines.core.data.sample_world import write_sample
    write_sample(Path("data/sample"), SampleDataParams(seed=1))   # usually run by pipelines.sample_data

Pure standard library; every random choice comes from RNGs seeded by `params.seed`, so the same
params give byte-identical files.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.core.params.data import SampleDataParams

ATTRIBUTES = ("city", "color", "pet", "job")
ARITH = "arith"

POOLS = {
    # Cities use consonant clusters and English-like endings, unlike the syllable-built people.
    "city": (
        "Pelora", "Dunmar", "Kestwick", "Varnholm", "Ostrell", "Brackmoor",
        "Saltinge", "Corvane", "Mirhaven", "Tolbridge", "Quenford", "Elsgrove",
    ),
    "color": ("red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "black", "white"),
    "pet": ("cat", "dog", "rabbit", "parrot", "hamster", "turtle", "owl", "goldfish", "iguana", "horse"),
    "job": ("baker", "teacher", "doctor", "farmer", "pilot", "engineer", "artist", "nurse", "lawyer", "chef"),
}  # fmt: skip

SYLLABLES = (
    "ba", "da", "do", "fe", "ka", "ki", "la", "li", "lo", "ma", "me", "mi", "na",
    "no", "ra", "re", "ri", "sa", "ta", "te", "to", "va", "vi", "vik", "rel", "dor",
)  # fmt: skip

# Bio sentences: {value} is the bare value, {a_value} the value with "a"/"an".
BIO_TEMPLATES = {
    "city": (
        "{name} lives in {value}.",
        "{name} is based in {value}.",
        "{name}'s home is in {value}.",
        "{name} resides in the city of {value}.",
    ),
    "color": (
        "{name}'s favorite color is {value}.",
        "{name} likes the color {value} most.",
        "The color {name} loves best is {value}.",
        "{name} prefers {value} to every other color.",
    ),
    "pet": (
        "{name} has a pet {value}.",
        "{name} owns {a_value}.",
        "{name} keeps {a_value} as a pet.",
        "{name} takes care of a pet {value}.",
    ),
    "job": (
        "{name} works as {a_value}.",
        "{name} is {a_value} by trade.",
        "{name} earns a living as {a_value}.",
        "By profession, {name} is {a_value}.",
    ),
}

SUM_TEMPLATES = (
    "{a} plus {b} equals {c}.",
    "{a} + {b} = {c}.",
    "The sum of {a} and {b} is {c}.",
    "Adding {a} and {b} gives {c}.",
)

QUESTION_TEMPLATES = {
    "city": (
        "Where does {name} live?",
        "In which city does {name} live?",
        "What city is {name} based in?",
    ),
    "color": (
        "What is {name}'s favorite color?",
        "Which color does {name} like most?",
        "What color does {name} love best?",
    ),
    "pet": (
        "What pet does {name} have?",
        "Which animal does {name} own?",
        "What animal does {name} keep as a pet?",
    ),
    "job": (
        "What does {name} do for a living?",
        "What is {name}'s job?",
        "What does {name} work as?",
    ),
    ARITH: (
        "What is {a} plus {b}?",
        "What is {a} + {b}?",
        "Compute {a} + {b}.",
    ),
}

WRONG_SUM_OFFSETS = (1, 2, 3, 10)
ARITH_SENTENCES_PER_DOC = (5, 10)
QA_PAIRS_PER_DOC = (4, 8)

COUNT_KEYS = (
    "pretrain_documents", "pretrain_chars", "chat_train", "chat_heldout", "preference_train",
    "preference_heldout", "entities", "heldout_entities", "arithmetic_pairs", "heldout_arithmetic_pairs",
    "chat_validation", "validation_entities", "validation_arithmetic_pairs",
)  # fmt: skip

FILES = {
    "pretrain": "pretrain.txt",
    "chat_train": "chat_train.jsonl",
    "chat_validation": "chat_validation.jsonl",
    "chat_heldout": "chat_heldout.jsonl",
    "preference_train": "preference_train.jsonl",
    "preference_heldout": "preference_heldout.jsonl",
    "world": "world.json",
}


class WorldError(ValueError):
    """The params ask for a world that cannot be built (e.g. more people than distinct names)."""


@dataclass(frozen=True)
class Entity:
    """One invented person."""

    name: str
    city: str
    color: str
    pet: str
    job: str
    heldout: bool
    validation: bool = False
    """A validation person: a training person's facts in the text, none of their questions trained on."""

    def value(self, attribute: str) -> str:
        return getattr(self, attribute)


@dataclass(frozen=True)
class World:
    """The people and which sums `a + b` (`0 <= a, b < max_operand`) are held out, or set aside for validation."""

    entities: tuple[Entity, ...]
    max_operand: int
    heldout_pairs: frozenset[tuple[int, int]]
    validation_pairs: frozenset[tuple[int, int]] = frozenset()

    def pairs(self, heldout: bool = False, validation: bool = False) -> list[tuple[int, int]]:
        """The held-out, the validation or (neither) the training sums, in (a, b) order."""
        every = itertools.product(range(self.max_operand), repeat=2)
        split = "heldout" if heldout else "validation" if validation else "train"
        return [pair for pair in every if self.split_of(pair) == split]

    def split_of(self, pair: tuple[int, int]) -> str:
        return "heldout" if pair in self.heldout_pairs else "validation" if pair in self.validation_pairs else "train"


@dataclass(frozen=True)
class Fact:
    """One question with one answer: a person's attribute (`kind` = the attribute) or a sum."""

    kind: str
    answer: str
    name: str = ""
    a: int = 0
    b: int = 0

    def ask(self, template: str) -> str:
        return template.format(name=self.name, a=self.a, b=self.b)

    def question(self, rng: random.Random) -> str:
        """The question in one of its wordings, chosen by `rng`."""
        return self.ask(rng.choice(QUESTION_TEMPLATES[self.kind]))


# ------------------------------------------------------------------------------------- the world


def _rng(seed: int, part: str) -> random.Random:
    # One RNG per part, so e.g. toggling qa_in_pretrain leaves the chats unchanged. String seeds
    # are hashed with SHA-512 by `random`, so they do not depend on PYTHONHASHSEED.
    return random.Random(f"qllm-sample:{seed}:{part}")


def _split_count(total: int, fraction: float) -> int:
    """How many of `total` to hold out: `fraction` of them, but at least one on each side."""
    return min(total - 1, max(1, round(total * fraction)))


def _names(rng: random.Random, n: int) -> list[str]:
    """`n` distinct names of 2-3 syllables, none a prefix of another name or of an attribute value.

    Prefix-free names keep a held-out name from hiding inside a training name ("Tavi" in
    "Tavilo"), which would leak it into training chats.
    """
    reserved = {value.lower() for pool in POOLS.values() for value in pool}
    taken = set(reserved)
    prefixes = {value[:k] for value in reserved for k in range(1, len(value))}
    candidates = ["".join(parts) for k in (2, 3) for parts in itertools.product(SYLLABLES, repeat=k)]
    rng.shuffle(candidates)
    names = []
    for candidate in candidates:
        if len(names) == n:
            break
        own_prefixes = {candidate[:k] for k in range(1, len(candidate))}
        if candidate in taken or candidate in prefixes or own_prefixes & taken:
            continue
        names.append(candidate.capitalize())
        taken.add(candidate)
        prefixes |= own_prefixes
    if len(names) < n:
        raise WorldError(f"n_entities={n} is more than the {len(names)} distinct names the syllables allow")
    return names


def build_world(params: SampleDataParams) -> World:
    """Invent the people, their attributes and the held-out split of people and sums.

    Args:
        params: the `generate` params section (seed, n_entities, fractions, max_operand).

    Returns:
        The world; depends only on those params, never on the rendering options.
    """
    rng = _rng(params.seed, "world")
    names = _names(rng, params.n_entities)
    heldout = set(rng.sample(range(len(names)), _split_count(len(names), params.heldout_entity_fraction)))
    entities = tuple(
        Entity(name=name, **{attr: rng.choice(POOLS[attr]) for attr in ATTRIBUTES}, heldout=index in heldout)
        for index, name in enumerate(names)
    )
    pairs = list(itertools.product(range(params.max_operand), repeat=2))
    heldout_pairs = rng.sample(pairs, _split_count(len(pairs), params.arithmetic_heldout_fraction))
    # the validation split is drawn from what is left, with its own RNG: a world without one (the
    # fractions 0) is the world of before, byte for byte
    chosen = _rng(params.seed, "validation")
    train_people = [i for i, entity in enumerate(entities) if not entity.heldout]
    validation = set(chosen.sample(train_people, _validation_count(len(train_people), len(names), params.validation_entity_fraction)))
    entities = tuple(dataclasses.replace(entity, validation=True) if i in validation else entity for i, entity in enumerate(entities))
    train_pairs = [pair for pair in pairs if pair not in set(heldout_pairs)]
    validation_pairs = chosen.sample(train_pairs, _validation_count(len(train_pairs), len(pairs), params.arithmetic_validation_fraction))
    return World(entities=entities, max_operand=params.max_operand, heldout_pairs=frozenset(heldout_pairs),
                 validation_pairs=frozenset(validation_pairs))  # fmt: skip


def _validation_count(available: int, total: int, fraction: float) -> int:
    """How many of the `available` training items to set aside: `fraction` of all `total`, at least
    one when the fraction is not 0, and never every training item."""
    if fraction == 0:
        return 0
    return min(available - 1, max(1, round(total * fraction)))


def facts(world: World, heldout: bool = False, validation: bool = False) -> list[Fact]:
    """Every held-out, validation or (neither) training fact: each person's four attributes, then each sum."""
    split = "heldout" if heldout else "validation" if validation else "train"
    people = [
        Fact(kind=attr, answer=entity.value(attr), name=entity.name)
        for entity in world.entities
        if _split(entity) == split
        for attr in ATTRIBUTES
    ]
    sums = [Fact(kind=ARITH, answer=str(a + b), a=a, b=b) for a, b in world.pairs(heldout, validation)]
    return people + sums


def _split(entity: Entity) -> str:
    return "heldout" if entity.heldout else "validation" if entity.validation else "train"


# ------------------------------------------------------------------------------- pretraining text


def _with_article(word: str) -> str:
    # The pools avoid words like "hour" or "unicorn" where the first letter misleads.
    return ("an " if word[0] in "aeiou" else "a ") + word


def _distinct_indices(rng: random.Random, total: int, k: int) -> list[int]:
    """`k` random indices below `total`, all different while `k <= total`, then repeating."""
    out: list[int] = []
    while len(out) < k:
        out += rng.sample(range(total), min(total, k - len(out)))
    return out


def _bios(rng: random.Random, entity: Entity, count: int) -> list[str]:
    """`count` bios of one person: all four attributes, in varied wording and order.

    No two bios of a person share all four templates (while `count` allows), so none is an exact
    or near duplicate (word 3-gram Jaccard stays well below prepare_data's 0.9) of another.
    """
    orders = list(itertools.permutations(ATTRIBUTES))
    combinations = math.prod(len(BIO_TEMPLATES[attr]) for attr in ATTRIBUTES)
    bios = []
    for index in _distinct_indices(rng, combinations, count):
        sentences = {}
        for attr in ATTRIBUTES:
            index, template = divmod(index, len(BIO_TEMPLATES[attr]))
            value = entity.value(attr)
            sentence = BIO_TEMPLATES[attr][template]
            sentences[attr] = sentence.format(name=entity.name, value=value, a_value=_with_article(value))
        bios.append(" ".join(sentences[attr] for attr in rng.choice(orders)))
    return bios


def _chunks(rng: random.Random, items: list[str], low: int, high: int) -> list[list[str]]:
    """Split `items` into consecutive chunks of `low..high` items (one shorter chunk only if
    there are fewer than `low` items in all)."""
    chunks, start = [], 0
    while len(items) - start > high:
        # Leave at least `low` items for the last chunk (needs high >= 2 * low - 1).
        size = rng.randint(low, min(high, len(items) - start - low))
        chunks.append(items[start : start + size])
        start += size
    if start < len(items):
        chunks.append(items[start:])
    return chunks


def _sum_documents(rng: random.Random, world: World, renderings: int) -> list[str]:
    """Every sum, held out or not, `renderings` times in random wordings, grouped into documents.

    A sum is one short sentence while a person's facts fill many bios, so sums need many
    renderings to be seen about as often as facts; with 2 the model learned almost none."""
    sentences = [
        rng.choice(SUM_TEMPLATES).format(a=a, b=b, c=a + b)
        for a, b in itertools.product(range(world.max_operand), repeat=2)
        for _ in range(renderings)
    ]
    rng.shuffle(sentences)
    return [" ".join(chunk) for chunk in _chunks(rng, sentences, *ARITH_SENTENCES_PER_DOC)]


def _qa_documents(rng: random.Random, train_facts: list[Fact], renderings: int) -> list[str]:
    """Each training fact `renderings` times as `Question: …` / `Answer: …` lines (a wording
    drawn each time), a few facts per document."""
    pairs = [f"Question: {fact.question(rng)}\nAnswer: {fact.answer}" for fact in train_facts for _ in range(renderings)]
    rng.shuffle(pairs)
    return ["\n".join(chunk) for chunk in _chunks(rng, pairs, *QA_PAIRS_PER_DOC)]


def _pretrain(rng: random.Random, world: World, params: SampleDataParams) -> list[str]:
    documents = [bio for entity in world.entities for bio in _bios(rng, entity, params.bios_per_entity)]
    documents += _sum_documents(rng, world, params.sum_renderings)
    if params.qa_in_pretrain:
        documents += _qa_documents(rng, facts(world, heldout=False), params.qa_renderings)
    rng.shuffle(documents)
    return documents


# ---------------------------------------------------------------------------- chats, preferences


def _id(split: str, fact: Fact, counters: dict[str, int], prefix: str = "") -> str:
    """`<prefix><split>-fact-<attribute>-<n>` or `<prefix><split>-arith-<n>`, numbered per type."""
    kind = "arith" if fact.kind == ARITH else f"fact-{fact.kind}"
    key = f"{prefix}{split}-{kind}"
    counters[key] = counters.get(key, 0) + 1
    return f"{key}-{counters[key] - 1}"


def _system(system_prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []


def _turn(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _train_chats(rng: random.Random, train_facts: list[Fact], params: SampleDataParams) -> list[dict[str, Any]]:
    """Each person fact twice (two different questions), each sum once; some chats get a second
    turn with another training fact."""
    counters: dict[str, int] = {}
    chats = []
    for index, fact in enumerate(train_facts):
        templates = QUESTION_TEMPLATES[fact.kind]
        questions = rng.sample(templates, 2) if fact.kind != ARITH else [rng.choice(templates)]
        for template in questions:
            messages = _system(params.system_prompt) + _turn(fact.ask(template), fact.answer)
            if rng.random() < params.multi_turn_fraction:
                # Draw from the other facts only, so the second turn never repeats the first.
                other = train_facts[(index + 1 + rng.randrange(len(train_facts) - 1)) % len(train_facts)]
                messages += _turn(other.question(rng), other.answer)
            chats.append({"id": _id("train", fact, counters), "messages": messages})
    rng.shuffle(chats)
    return chats


def _heldout_chats(rng: random.Random, heldout_facts: list[Fact], system_prompt: str, split: str = "heldout") -> list[dict[str, Any]]:
    """Each held-out (or validation) fact in every wording of its question, single-turn (more
    questions make exact-match differences between models smaller than one unlucky answer)."""
    counters: dict[str, int] = {}
    chats = []
    for fact in heldout_facts:
        for template in QUESTION_TEMPLATES[fact.kind]:
            messages = _system(system_prompt) + _turn(fact.ask(template), fact.answer)
            chats.append({"id": _id(split, fact, counters), "messages": messages})
    # Shuffled so that evaluating only the first `max_questions` still mixes every type.
    rng.shuffle(chats)
    return chats


def _copied_answer(rng: random.Random, fact: Fact, people: dict[str, Entity], in_use: dict[str, set[str]]) -> str:
    """A weak model's copy slip: it repeats the person's name, or a number from the question."""
    if fact.kind == ARITH:
        copies = [str(x) for x in (fact.a, fact.b) if str(x) != fact.answer]
        return rng.choice(copies) if copies else str(int(fact.answer) + 1)
    return fact.name


def _confused_answer(rng: random.Random, fact: Fact, people: dict[str, Entity], in_use: dict[str, set[str]]) -> str:
    """A weak model's attribute confusion: another true fact about the same person (asked for the
    city, it gives the pet); sums as `_copied_answer`."""
    if fact.kind == ARITH:
        return _copied_answer(rng, fact, people, in_use)
    person = people[fact.name]
    return rng.choice([person.value(attr) for attr in ATTRIBUTES if attr != fact.kind and person.value(attr) != fact.answer])


def _wrong_value(rng: random.Random, fact: Fact, people: dict[str, Entity], in_use: dict[str, set[str]]) -> str:
    """A wrong value of the right kind: another value some person has, or the sum off by a bit."""
    if fact.kind == ARITH:
        c = int(fact.answer)
        options = [c + d for d in WRONG_SUM_OFFSETS] + [c - d for d in WRONG_SUM_OFFSETS if c - d >= 0]
        return str(rng.choice(options))
    options = [value for value in POOLS[fact.kind] if value != fact.answer and value in in_use[fact.kind]]
    return rng.choice(options or [value for value in POOLS[fact.kind] if value != fact.answer])


# `sample_data.preference_errors` -> how a pair's rejected answer is made
WRONG_ANSWERS = {"copy": _copied_answer, "confusion": _confused_answer, "value": _wrong_value}


def _preferences(rng: random.Random, world: World, split: str, params: SampleDataParams) -> list[dict[str, Any]]:
    """One TRL conversational preference record per fact of the split; the rejected answer is a
    plausible wrong one of the kind `params.preference_errors` names."""
    in_use = {attr: {entity.value(attr) for entity in world.entities} for attr in ATTRIBUTES}
    people = {entity.name: entity for entity in world.entities}

    def wrong(fact: Fact) -> str:
        return WRONG_ANSWERS[params.preference_errors](rng, fact, people, in_use)

    counters: dict[str, int] = {}
    records = [
        {
            "id": _id(split, fact, counters, prefix="pref-"),
            "prompt": _system(params.system_prompt) + [{"role": "user", "content": fact.question(rng)}],
            "chosen": [{"role": "assistant", "content": fact.answer}],
            "rejected": [{"role": "assistant", "content": wrong(fact)}],
        }
        for fact in facts(world, heldout=split == "heldout")
    ]
    rng.shuffle(records)
    return records


# ------------------------------------------------------------------------- arithmetic with a tool

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": 'The expression, for example "123 * 457 + 89".'}},
                       "required": ["expression"]},
        "return": {"type": "string"},
    },
}  # fmt: skip
"""`pipelines.core.rl.tools.calculator`'s schema (this module is standard library only; a test
checks that the two agree)."""


def _tool_question(rng: random.Random, digits: int, product: bool) -> tuple[str, str, str]:
    """(question, the calculator expression, the answer): a product of two or a sum of four numbers
    of `digits` digits each."""
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    if product:
        a, b = rng.randint(low, high), rng.randint(low, high)
        return f"What is {a} times {b}?", f"{a} * {b}", str(a * b)
    terms = [rng.randint(low, high) for _ in range(4)]
    return f"What is {' plus '.join(map(str, terms))}?", " + ".join(map(str, terms)), str(sum(terms))


def _tool_chats(rng: random.Random, params: SampleDataParams, split: str, seen: set[str]) -> list[dict[str, Any]]:
    """Per difficulty, `train` demonstrations (the calculator called, its answer, the final answer)
    or `heldout` plain questions, half products and half sums; no question is asked twice across
    the splits (`seen`)."""
    settings = params.tool_arithmetic
    count = settings.train if split == "train" else settings.heldout
    chats = []
    for digits in settings.digits:
        made = 0
        while made < count:
            question, expression, answer = _tool_question(rng, digits, product=made % 2 == 0)
            if question in seen:
                continue
            seen.add(question)
            messages = _system(params.system_prompt) + [{"role": "user", "content": question}]
            if split == "train" and settings.calls:
                call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
                messages += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "name": "calculator", "content": answer}]
            messages.append({"role": "assistant", "content": answer})
            chats.append({"id": f"{split}-toolarith-d{digits}-{made}", "messages": messages, **({"tools": [CALCULATOR_SCHEMA]} if settings.calls else {})})
            made += 1
    return chats


def render(world: World, params: SampleDataParams) -> dict[str, list]:
    """Render the world as pretraining documents, chats and preferences.

    Args:
        world: from `build_world(params)`.
        params: the `generate` section (seed, bios_per_entity, qa_in_pretrain, multi_turn_fraction,
            system_prompt).

    Returns:
        `{"pretrain": [str], "chat_train" | "chat_heldout" | "preference_train" |
        "preference_heldout": [dict]}`.
    """
    seed = params.seed
    rendered = {
        "pretrain": _pretrain(_rng(seed, "pretrain"), world, params),
        "chat_train": _train_chats(_rng(seed, "chat_train"), facts(world, heldout=False), params),
        "chat_heldout": _heldout_chats(_rng(seed, "chat_heldout"), facts(world, heldout=True), params.system_prompt),
        "preference_train": _preferences(_rng(seed, "preference_train"), world, "train", params),
        "preference_heldout": _preferences(_rng(seed, "preference_heldout"), world, "heldout", params),
    }
    if facts(world, validation=True):  # its own RNG: a world without validation people renders as before
        rendered["chat_validation"] = _heldout_chats(_rng(seed, "chat_validation"), facts(world, validation=True), params.system_prompt, "validation")
    if params.tool_arithmetic.enabled:  # its own RNG: the other chats keep their bytes
        rng, seen = _rng(seed, "tool_arithmetic"), set()
        rendered["chat_train"] += _tool_chats(rng, params, "train", seen)
        rendered["chat_heldout"] += _tool_chats(rng, params, "heldout", seen)
    return rendered


# ------------------------------------------------------------------------------------ the files


def _world_record(world: World, seed: int) -> dict[str, Any]:
    return {
        "seed": seed,
        "attributes": list(ATTRIBUTES),
        "entities": [
            {"name": e.name, **{attr: e.value(attr) for attr in ATTRIBUTES}, "heldout": e.heldout, **({"validation": True} if e.validation else {})}
            for e in world.entities
        ],
        "max_operand": world.max_operand,
        "heldout_arithmetic": [[a, b] for a, b in world.pairs(heldout=True)],
        **({"validation_arithmetic": [[a, b] for a, b in world.pairs(validation=True)]} if world.validation_pairs else {}),
    }


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    path.write_text(lines, encoding="utf-8", newline="\n")


def write_sample(out_dir: Path, params: SampleDataParams) -> dict[str, int]:
    """Build the world and write every sample file into `out_dir` (created if missing).

    Args:
        out_dir: destination directory; files of the same names are overwritten.
        params: the `generate` params section.

    Returns:
        The counts named in `COUNT_KEYS`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    world = build_world(params)
    rendered = render(world, params)
    # Documents are separated by one blank line; none contains one, so the split is unambiguous.
    pretrain = "\n\n".join(rendered["pretrain"]) + "\n"
    (out_dir / FILES["pretrain"]).write_text(pretrain, encoding="utf-8", newline="\n")
    for name in ("chat_train", "chat_heldout", "preference_train", "preference_heldout"):
        _write_jsonl(out_dir / FILES[name], rendered[name])
    if "chat_validation" in rendered:
        _write_jsonl(out_dir / FILES["chat_validation"], rendered["chat_validation"])
    world_json = json.dumps(_world_record(world, params.seed), ensure_ascii=False, indent=2) + "\n"
    (out_dir / FILES["world"]).write_text(world_json, encoding="utf-8", newline="\n")
    heldout_entities = sum(entity.heldout for entity in world.entities)
    return {
        "pretrain_documents": len(rendered["pretrain"]),
        "pretrain_chars": len(pretrain),
        "chat_train": len(rendered["chat_train"]),
        "chat_heldout": len(rendered["chat_heldout"]),
        "preference_train": len(rendered["preference_train"]),
        "preference_heldout": len(rendered["preference_heldout"]),
        "entities": len(world.entities),
        "heldout_entities": heldout_entities,
        "arithmetic_pairs": world.max_operand**2,
        "heldout_arithmetic_pairs": len(world.heldout_pairs),
        "chat_validation": len(rendered.get("chat_validation", [])),
        "validation_entities": sum(entity.validation for entity in world.entities),
        "validation_arithmetic_pairs": len(world.validation_pairs),
    }
