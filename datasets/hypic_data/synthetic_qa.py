"""Deterministic generator of synthetic multi-document question answering.

Every example is a small invented world (people, companies, cities, countries) rendered
as a handful of short documents, plus one question whose answer is written verbatim in
exactly the documents that support it:

- ``single_hop``: the answer sits in one document ("Where was Mira Tolvan born?");
- ``multi_hop``: a bridge question in the style of HotpotQA ("Where was the founder of
  Kesh Labs born?"): document A links the question's entity to a bridge entity, document
  B holds the bridge entity's fact; the answer is only in B and the question's entity is
  not in B, so both documents are needed.

The remaining documents are distractors of the same kinds. Each example is generated from
its own random stream, seeded by (seed, split, index), so the same seed yields the same
bytes and a split of N examples is a prefix of a split of M > N examples.

Command line: ``python -m hypic_data.synthetic_qa --out datasets/synthetic_qa`` (``--splits test``
writes only the test split, the one the evaluations read: the same bytes as a full run's).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

DEFAULT_SEPARATOR = "<<PIC_SEP>>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPLITS = ("train", "validation", "test")
INSTRUCTION = (
    "Answer the question using only the documents below. "
    "Reply with a short answer copied from the documents."
)
# Each prompt part starts with whitespace and ends with a non-space character, so that
# byte-level BPE pre-tokenization never merges across part boundaries: encoding the
# parts one by one gives the same ids as encoding the concatenated text.
PART_PREFIX = "\n\n"
QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"

KINDS = ("person", "company", "city", "country")
KIND_WEIGHTS = (4, 3, 3, 2)
# Undocumented entities that documents may still mention (targets of relations).
EXTRA_ENTITIES = MappingProxyType({"person": 2, "company": 2, "city": 3, "country": 2})

ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
          "z", "br", "dr", "gr", "kr", "st", "tr", "th", "sh", "ch")
NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou", "ia")
CODAS = ("", "", "", "n", "r", "l", "s", "m", "th", "nd", "rk")

COMPANY_SUFFIXES = ("Labs", "Systems", "Industries", "Works", "Group", "Holdings",
                    "Dynamics", "Partners", "Company", "Trading")
LANGUAGE_SUFFIXES = ("ese", "ic", "ian", "ish")
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "grey", "brown",
           "black", "white", "pink", "violet", "teal", "amber", "crimson", "indigo",
           "turquoise", "maroon", "silver", "golden", "beige", "olive")
PROFESSIONS = ("glassblower", "baker", "architect", "marine biologist", "carpenter",
               "librarian", "pilot", "pharmacist", "violinist", "surveyor",
               "cartographer", "beekeeper", "geologist", "translator", "watchmaker",
               "nurse", "chemist", "jeweller", "sculptor", "tailor", "potter",
               "astronomer", "locksmith", "botanist", "dentist", "electrician")
PRODUCTS = ("bicycles", "solar panels", "umbrellas", "wooden toys", "pianos",
            "telescopes", "sailboats", "ceramic tiles", "board games", "lanterns",
            "typewriters", "kites", "hiking boots", "candles", "fountain pens",
            "microscopes", "tractors", "wristwatches", "radios", "sewing machines",
            "chocolate bars", "garden hoses")

# (kind, attribute) -> kind of the entity the attribute points to.
RELATIONS = MappingProxyType({
    ("person", "born_in"): "city",
    ("person", "works_for"): "company",
    ("company", "founder"): "person",
    ("company", "hq"): "city",
    ("city", "country"): "country",
    ("city", "mayor"): "person",
    ("country", "capital"): "city",
})
LITERALS = MappingProxyType({
    "person": ("profession", "colour", "birth_year"),
    "company": ("product", "founded", "employees"),
    "city": ("river", "population", "founded"),
    "country": ("currency", "language", "flag"),
})

# {S}: subject at sentence start, {s}: subject inside a sentence, {v}: value,
# {av}: value with its indefinite article.
FACT_TEMPLATES = MappingProxyType({
    ("person", "born_in"): ("{S} was born in {v}.", "{S} was born and raised in {v}.",
                            "{S} spent an entire childhood in {v}, the city of their birth."),
    ("person", "works_for"): ("{S} works for {v}.", "{S} is employed by {v}.",
                              "These days {s} works for {v}."),
    ("person", "profession"): ("{S} works as {av}.", "By profession, {s} is {av}.",
                               "{S} trained for many years to become {av}."),
    ("person", "colour"): ("The favourite colour of {s} is {v}.",
                           "{S} says that {v} is their favourite colour."),
    ("person", "birth_year"): ("{S} was born in the year {v}.", "{S} came into the world in {v}."),
    ("company", "founder"): ("{S} was founded by {v}.", "{v} founded {s}.",
                             "The founder of {s} is {v}."),
    ("company", "hq"): ("{S} is headquartered in {v}.", "The headquarters of {s} are in {v}.",
                        "{S} has its main office in {v}."),
    ("company", "product"): ("{S} makes {v}.", "{S} is best known for making {v}.",
                             "{S} produces {v} for customers across the region."),
    ("company", "founded"): ("{S} was established in {v}.", "{S} opened its doors in {v}."),
    ("company", "employees"): ("{S} employs {v} people.", "{S} has {v} employees."),
    ("city", "country"): ("{S} is a city in {v}.", "{S} lies in {v}.", "{S} is located in {v}."),
    ("city", "river"): ("The {v} flows through {s}.", "{S} sits on the banks of the {v}."),
    ("city", "population"): ("{S} has a population of {v}.", "About {v} people live in {s}."),
    ("city", "mayor"): ("The mayor of {s} is {v}.", "{v} is the mayor of {s}.",
                        "{S} is governed by its mayor, {v}."),
    ("city", "founded"): ("{S} was founded in {v}.", "{S} was first settled in {v}."),
    ("country", "capital"): ("The capital of {s} is {v}.", "{v} is the capital of {s}."),
    ("country", "currency"): ("The currency of {s} is the {v}.", "People in {s} pay with the {v}."),
    ("country", "language"): ("Most people in {s} speak {v}.",
                              "The official language of {s} is {v}."),
    ("country", "flag"): ("The flag of {s} is mostly {v}.", "{S} has a mostly {v} flag."),
})

# Questions about an attribute; {s} is the entity's name or a bridge phrase.
QUESTIONS = MappingProxyType({
    ("person", "born_in"): "Where was {s} born?",
    ("person", "works_for"): "Which company does {s} work for?",
    ("person", "profession"): "What is the profession of {s}?",
    ("person", "colour"): "What is the favourite colour of {s}?",
    ("person", "birth_year"): "In what year was {s} born?",
    ("company", "founder"): "Who founded {s}?",
    ("company", "hq"): "In which city is {s} headquartered?",
    ("company", "product"): "What does {s} make?",
    ("company", "founded"): "In what year was {s} established?",
    ("company", "employees"): "How many people does {s} employ?",
    ("city", "country"): "In which country is {s}?",
    ("city", "river"): "Which river flows through {s}?",
    ("city", "population"): "What is the population of {s}?",
    ("city", "mayor"): "Who is the mayor of {s}?",
    ("city", "founded"): "In what year was {s} founded?",
    ("country", "capital"): "What is the capital of {s}?",
    ("country", "currency"): "What is the currency of {s}?",
    ("country", "language"): "Which language do most people in {s} speak?",
    ("country", "flag"): "What is the main colour of the flag of {s}?",
})

# How a relation's target is described in a multi-hop question; {x} is the anchor name.
BRIDGE_PHRASES = MappingProxyType({
    ("person", "born_in"): "the city where {x} was born",
    ("person", "works_for"): "the company that {x} works for",
    ("company", "founder"): "the founder of {x}",
    ("company", "hq"): "the city where {x} is headquartered",
    ("city", "country"): "the country in which {x} lies",
    ("city", "mayor"): "the mayor of {x}",
    ("country", "capital"): "the capital of {x}",
})

FILLERS = MappingProxyType({
    "person": (
        "{S} enjoys long walks along quiet roads on the weekend.",
        "Friends describe {s} as patient, curious and good at listening.",
        "In the evenings {s} likes to read old novels and write letters.",
        "{S} once spent a whole summer learning how to sail a small boat.",
        "Neighbours say that {s} is always willing to help with small repairs.",
        "{S} keeps a small garden with herbs and tomatoes behind the house.",
        "Every spring {s} travels to visit relatives in the countryside.",
        "{S} has a large collection of postcards from many different places.",
        "Colleagues value {s} for careful work and a calm manner.",
        "{S} rarely misses the weekly chess evening at the local club.",
        "On holidays {s} prefers the mountains to the beach.",
        "{S} learned to cook from an older cousin and still uses the same recipes.",
    ),
    "company": (
        "{S} started as a small workshop with only a handful of staff.",
        "Customers often praise the company for its reliable service.",
        "{S} publishes a short report about its work every year.",
        "The company runs a training programme for young apprentices.",
        "{S} sponsors a local football team and a summer music festival.",
        "Over the years the company has opened offices in several regions.",
        "{S} has a reputation for treating its staff fairly.",
        "The company invests a part of its profits in research.",
        "Critics say that {s} grew too quickly in its early years.",
        "{S} sells most of its goods through small independent shops.",
        "The company logo shows a stylised bird above a wave.",
        "{S} recently moved part of its production to a new factory.",
    ),
    "city": (
        "{S} is known for its narrow streets and old stone bridges.",
        "A busy market fills the main square of {s} every week.",
        "Visitors often come to {s} for its museums and quiet parks.",
        "The old town of {s} has many houses with wooden balconies.",
        "In winter the streets of {s} are decorated with lights.",
        "{S} has a small university and several public libraries.",
        "Trains connect {s} with the surrounding towns every hour.",
        "The city hosts a popular food festival at the end of summer.",
        "Many families have lived in {s} for generations.",
        "A tall clock tower stands near the centre of {s}.",
        "The bakeries of {s} open long before sunrise.",
        "Cyclists share the main avenues of {s} with slow trams.",
    ),
    "country": (
        "{S} is known for its mountains, forests and deep lakes.",
        "Tourists visit {s} mainly in the summer months.",
        "The country has a long tradition of folk music and dance.",
        "{S} borders the sea on one side and high hills on the other.",
        "Farming remains important in the rural regions of {s}.",
        "The parliament of {s} meets in a large hall built of stone.",
        "Railways link the major towns of the country.",
        "{S} celebrates its national day with parades and fireworks.",
        "Many small villages in {s} still keep their old customs.",
        "The country exports timber, grain and wool.",
        "Winters in {s} can be long and snowy.",
        "Children in {s} start school at the end of summer.",
    ),
})

SHORT_FORMS = MappingProxyType({"company": "the company", "city": "the city",
                                "country": "the country"})
MIN_ANSWER_WORDS = 1
MAX_ANSWER_WORDS = 3
MAX_ATTEMPTS = 200


@dataclass(frozen=True)
class GeneratorConfig:
    """Parameters of the generator; every field changes the generated bytes."""

    seed: int = 1234
    min_docs: int = 4
    max_docs: int = 12
    multi_hop_fraction: float = 0.5
    min_doc_words: int = 80
    max_doc_words: int = 200
    extra_questions: int = 0  # training aid: more valid questions about the same documents


@dataclass
class Entity:
    """One invented entity: literal facts and links (indices) to other entities."""

    kind: str
    name: str
    short: str
    literals: dict[str, str] = field(default_factory=dict)
    links: dict[str, int] = field(default_factory=dict)


@dataclass
class World:
    """All entities of one example; ``documented`` are those that get a document."""

    entities: list[Entity]
    documented: list[int]


@dataclass(frozen=True)
class Candidate:
    """A question with its answer and supporting entities in hop order."""

    kind: str
    question: str
    answer: str
    support: tuple[int, ...]
    anchor: str
    bridge: str | None = None


class _Namer:
    """Draws invented words and unique values for one world (per-example state)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.words: set[str] = set(_RESERVED_WORDS)  # lower-case names in use
        self.values: set[str] = set()  # literal values in use

    def word(self, min_syl: int = 2, max_syl: int = 3, suffix: str = "") -> str:
        """A fresh capitalised invented word (stem + ``suffix``), unused in this world."""
        while True:
            n = self.rng.randint(min_syl, max_syl)
            stem = "".join(self.rng.choice(ONSETS) + self.rng.choice(NUCLEI)
                           + self.rng.choice(CODAS) for _ in range(n))
            text = stem + suffix
            if 4 <= len(stem) <= 9 and not {stem, text} & self.words:
                self.words.update({stem, text})
                return text.capitalize()

    def pick(self, pool: Sequence[str]) -> str:
        """A value from ``pool`` not used yet in this world."""
        value = self.rng.choice([item for item in pool if item not in self.values])
        self.values.add(value)
        return value

    def number(self, low: int, high: int) -> str:
        """A decimal number in [low, high] not used yet in this world."""
        while True:
            text = str(self.rng.randint(low, high))
            if text not in self.values:
                self.values.add(text)
                return text


def _template_words() -> frozenset[str]:
    """Lower-case words of all fixed text, so invented names never collide with them."""
    texts: list[str] = [INSTRUCTION, QUESTION_TEMPLATE, *COMPANY_SUFFIXES, *COLOURS,
                        *PROFESSIONS, *PRODUCTS, *QUESTIONS.values(), *BRIDGE_PHRASES.values()]
    for group in (*FACT_TEMPLATES.values(), *FILLERS.values()):
        texts.extend(group)
    return frozenset(w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t))


_RESERVED_WORDS = _template_words() | {"river"}


def mentions(text: str, phrase: str) -> bool:
    """True if ``phrase`` occurs in ``text`` as whole words (case-insensitive)."""
    if phrase.lower() not in text.lower():  # cheap test first; the regex is rarely needed
        return False
    pattern = r"(?<!\w)" + re.escape(phrase) + r"(?!\w)"
    return re.search(pattern, text, flags=re.IGNORECASE) is not None


def _article(word: str) -> str:
    """Indefinite article for ``word``."""
    return "an" if word[0].lower() in "aeiou" else "a"


def _new_entity(kind: str, namer: _Namer) -> Entity:
    """An entity with an invented name and its literal facts."""
    if kind == "person":
        first, last = namer.word(2, 2), namer.word(1, 2)
        entity = Entity(kind, f"{first} {last}", first)
    elif kind == "company":
        name = f"{namer.word(2, 2)} {namer.rng.choice(COMPANY_SUFFIXES)}"
        entity = Entity(kind, name, SHORT_FORMS[kind])
    else:
        entity = Entity(kind, namer.word(2, 3), SHORT_FORMS[kind])
    entity.literals = _literals(kind, namer)
    return entity


def _literals(kind: str, namer: _Namer) -> dict[str, str]:
    """Literal facts of a new entity of ``kind``."""
    if kind == "person":
        return {"profession": namer.pick(PROFESSIONS), "colour": namer.pick(COLOURS),
                "birth_year": namer.number(1940, 2004)}
    if kind == "company":
        return {"product": namer.pick(PRODUCTS), "founded": namer.number(1820, 2015),
                "employees": namer.number(40, 9800)}
    if kind == "city":
        return {"river": f"{namer.word(2, 2)} River", "population": namer.number(12000, 950000),
                "founded": namer.number(900, 1890)}
    suffix = namer.rng.choice(LANGUAGE_SUFFIXES)
    return {"currency": namer.word(2, 2).lower(), "language": namer.word(2, 2, suffix),
            "flag": namer.pick(COLOURS)}


def _choose_target(rng: random.Random, world: World, kind: str, exclude: set[int]) -> int:
    """Index of an entity of ``kind`` (documented ones preferred, for more multi-hop)."""
    pool = [i for i, e in enumerate(world.entities) if e.kind == kind and i not in exclude]
    documented = [i for i in pool if i in world.documented]
    if documented and rng.random() < 0.7:
        return rng.choice(documented)
    return rng.choice(pool)


def _link_capitals(rng: random.Random, world: World, namer: _Namer) -> None:
    """Give each country its own capital city and put that city in the country."""
    taken: set[int] = set()
    for i, entity in enumerate(list(world.entities)):
        if entity.kind != "country":
            continue
        cities = [j for j, e in enumerate(world.entities) if e.kind == "city" and j not in taken]
        if not cities:  # more countries than cities: add an undocumented city
            world.entities.append(_new_entity("city", namer))
            cities = [len(world.entities) - 1]
        capital = rng.choice(cities)
        taken.add(capital)
        entity.links["capital"] = capital
        world.entities[capital].links["country"] = i


def _link_mayors(rng: random.Random, world: World, namer: _Namer) -> None:
    """Give each city a distinct mayor."""
    taken: set[int] = set()
    for entity in [e for e in world.entities if e.kind == "city"]:
        others = {j for j, e in enumerate(world.entities) if e.kind != "person"}
        people = [j for j, e in enumerate(world.entities) if e.kind == "person" and j not in taken]
        if not people:  # every person is a mayor already: add an undocumented one
            world.entities.append(_new_entity("person", namer))
        mayor = _choose_target(rng, world, "person", taken | others)
        taken.add(mayor)
        entity.links["mayor"] = mayor


def _link_rest(rng: random.Random, world: World) -> None:
    """Fill the remaining relations with random targets."""
    for i, entity in enumerate(world.entities):
        for (kind, attr), target_kind in RELATIONS.items():
            if kind == entity.kind and attr not in entity.links:
                entity.links[attr] = _choose_target(rng, world, target_kind, {i})


def build_world(rng: random.Random, n_docs: int) -> World:
    """A consistent world with ``n_docs`` documented entities and a few extra ones."""
    namer = _Namer(rng)
    kinds = rng.choices(KINDS, weights=KIND_WEIGHTS, k=n_docs)
    kinds += [kind for kind in KINDS for _ in range(EXTRA_ENTITIES[kind])]
    world = World([_new_entity(kind, namer) for kind in kinds], list(range(n_docs)))
    _link_capitals(rng, world, namer)
    _link_mayors(rng, world, namer)
    _link_rest(rng, world)
    return world


def value_text(world: World, entity: Entity, attr: str) -> str:
    """The surface text of an attribute's value (a literal or a linked entity's name)."""
    if attr in entity.links:
        return world.entities[entity.links[attr]].name
    return entity.literals[attr]


def _attributes(kind: str) -> list[str]:
    """All attributes of an entity kind, relations first."""
    return [a for (k, a) in RELATIONS if k == kind] + list(LITERALS[kind])


def _subject_forms(entity: Entity, rng: random.Random, first: bool) -> dict[str, str]:
    """Template fields naming the subject: the full name first, later sometimes short."""
    name = entity.name if first or rng.random() < 0.5 else entity.short
    return {"s": name, "S": name[0].upper() + name[1:]}


def _fact_sentence(world: World, entity: Entity, attr: str, rng: random.Random,
                   first: bool) -> str:
    """One sentence stating ``attr`` of ``entity``."""
    value = value_text(world, entity, attr)
    template = rng.choice(FACT_TEMPLATES[(entity.kind, attr)])
    fields = _subject_forms(entity, rng, first)
    return template.format(v=value, av=f"{_article(value)} {value}", **fields)


def render_document(world: World, index: int, rng: random.Random,
                    config: GeneratorConfig) -> str:
    """The document of entity ``index``: all its facts plus filler, as one paragraph."""
    entity = world.entities[index]
    attrs = _attributes(entity.kind)
    rng.shuffle(attrs)
    facts = [_fact_sentence(world, entity, a, rng, i == 0) for i, a in enumerate(attrs)]
    fillers = list(FILLERS[entity.kind])
    rng.shuffle(fillers)
    target = rng.randint(config.min_doc_words, (config.min_doc_words + config.max_doc_words) // 2)
    body = facts[1:]
    while fillers and _word_count([facts[0], *body]) < target:
        body.insert(rng.randint(0, len(body)), fillers.pop().format(**_subject_forms(entity, rng, False)))
    return " ".join([facts[0], *body])


def _word_count(sentences: Iterable[str]) -> int:
    """Number of whitespace-separated words in ``sentences``."""
    return sum(len(s.split()) for s in sentences)


def _single_hop(world: World) -> Iterator[Candidate]:
    """Every single-hop question about a documented entity."""
    for i in world.documented:
        entity = world.entities[i]
        for attr in _attributes(entity.kind):
            question = QUESTIONS[(entity.kind, attr)].format(s=entity.name)
            yield Candidate("single_hop", question, value_text(world, entity, attr), (i,),
                            entity.name)


def _multi_hop(world: World) -> Iterator[Candidate]:
    """Every bridge question from a documented entity through a documented link."""
    for i in world.documented:
        anchor = world.entities[i]
        for attr, j in anchor.links.items():
            if j not in world.documented or j == i:
                continue
            bridge = world.entities[j]
            phrase = BRIDGE_PHRASES[(anchor.kind, attr)].format(x=anchor.name)
            for attr2 in _attributes(bridge.kind):
                question = QUESTIONS[(bridge.kind, attr2)].format(s=phrase)
                yield Candidate("multi_hop", question, value_text(world, bridge, attr2),
                                (i, j), anchor.name, bridge.name)


def example_problems(kind: str, documents: Sequence[str], question: str, answer: str,
                     support: Sequence[int], anchor: str | None = None,
                     bridge: str | None = None) -> list[str]:
    """Why an example is invalid (empty list when valid).

    The answer must appear in exactly one document: the only supporting document for
    single-hop, the second (answer-holding) one for multi-hop. For multi-hop the first
    document must name the bridge entity, and the answer document must not name the
    question's anchor entity, so neither document alone answers the question.
    """
    problems = []
    if not MIN_ANSWER_WORDS <= len(answer.split()) <= MAX_ANSWER_WORDS:
        problems.append(f"answer {answer!r} is not 1-3 words")
    if mentions(question, answer):
        problems.append("answer appears in the question")
    holders = [i for i, doc in enumerate(documents) if mentions(doc, answer)]
    if holders != [support[-1]]:
        problems.append(f"answer in documents {holders}, expected [{support[-1]}]")
    expected_hops = 1 if kind == "single_hop" else 2
    if len(support) != expected_hops or len(set(support)) != len(support):
        problems.append(f"{kind} needs {expected_hops} distinct supporting documents")
    if kind == "multi_hop" and anchor is not None and bridge is not None:
        problems.extend(_bridge_problems(documents, question, support, anchor, bridge))
    return problems


def _bridge_problems(documents: Sequence[str], question: str, support: Sequence[int],
                     anchor: str, bridge: str) -> list[str]:
    """Checks that make a bridge question need both of its documents."""
    first, second = documents[support[0]], documents[support[1]]
    problems = []
    if not (mentions(first, anchor) and mentions(first, bridge) and mentions(second, bridge)):
        problems.append("bridge entity does not link the two supporting documents")
    if mentions(second, anchor):
        problems.append("answer document names the anchor entity")
    if mentions(question, bridge) or not mentions(question, anchor):
        problems.append("question must name the anchor and not the bridge")
    return problems


def _valid(candidate: Candidate, documents: list[str], position: dict[int, int]) -> bool:
    """Whether ``candidate`` is unambiguous given the rendered documents."""
    support = [position[e] for e in candidate.support]
    return not example_problems(candidate.kind, documents, candidate.question,
                                candidate.answer, support, candidate.anchor, candidate.bridge)


def _attempt(rng: random.Random, config: GeneratorConfig, kind: str) -> dict | None:
    """One try at an example of ``kind``; None when the world has no valid question."""
    world = build_world(rng, rng.randint(config.min_docs, config.max_docs))
    order = list(world.documented)
    rng.shuffle(order)
    documents = [render_document(world, i, rng, config) for i in order]
    if not all(config.min_doc_words <= len(d.split()) <= config.max_doc_words for d in documents):
        return None
    position = {entity: doc for doc, entity in enumerate(order)}
    pool = _single_hop(world) if kind == "single_hop" else _multi_hop(world)
    valid = [c for c in pool if _valid(c, documents, position)]
    if not valid:
        return None
    chosen = rng.choice(valid)
    support = [position[e] for e in chosen.support]
    draft = {"kind": kind, "instruction": INSTRUCTION, "documents": documents,
             "question": chosen.question, "answer": chosen.answer, "supporting_docs": support,
             "_anchor": chosen.anchor, "_bridge": chosen.bridge}
    if config.extra_questions > 0:
        draft["extra_questions"] = _extra_questions(world, documents, position, chosen,
                                                    config.extra_questions)
    return draft


def _extra_questions(world: World, documents: list[str], position: dict[int, int],
                     chosen: Candidate, count: int) -> list[dict]:
    """Up to ``count`` other valid questions (either kind) about the same documents.

    They are drawn from their own stream (seeded by the chosen question), so the rest of
    the example is the same with or without them.
    """
    pool = [c for c in (*_single_hop(world), *_multi_hop(world))
            if c.question != chosen.question and _valid(c, documents, position)]
    picked = random.Random(f"extra|{chosen.question}").sample(pool, min(count, len(pool)))
    return [{"kind": c.kind, "question": c.question, "answer": c.answer,
             "supporting_docs": [position[e] for e in c.support]} for c in picked]


def generate_example(config: GeneratorConfig, split: str, index: int) -> dict:
    """Example ``index`` of ``split``, from its own seeded random stream."""
    rng = random.Random(f"hypic-synthetic-qa|{config.seed}|{split}|{index}")
    kind = "multi_hop" if rng.random() < config.multi_hop_fraction else "single_hop"
    for _ in range(MAX_ATTEMPTS):  # regenerate the world on any collision
        draft = _attempt(rng, config, kind)
        if draft is not None:
            return _finish(draft, split, index)
    raise RuntimeError(f"no valid {kind} example for {split}/{index} in {MAX_ATTEMPTS} tries")


def _finish(draft: dict, split: str, index: int) -> dict:
    """Re-check a drafted example and give it its public field order."""
    anchor, bridge = draft.pop("_anchor"), draft.pop("_bridge")
    problems = example_problems(draft["kind"], draft["documents"], draft["question"],
                                draft["answer"], draft["supporting_docs"], anchor, bridge)
    if problems:  # cannot happen unless the filter above is broken
        raise AssertionError(f"{split}/{index}: {problems}")
    return {"id": f"{split}-{index:06d}", "split": split, **draft}


def generate_split(config: GeneratorConfig, split: str, count: int,
                   workers: int = 1) -> Iterator[dict]:
    """The first ``count`` examples of ``split``, in order.

    With ``workers`` > 1 they are drawn in that many processes; every example has its own
    seeded stream, so the output is the same as with one.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if workers <= 1:
        yield from (generate_example(config, split, index) for index in range(count))
        return
    import multiprocessing
    from functools import partial

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap(partial(generate_example, config, split), range(count), chunksize=64)


def prompt_parts(example: dict) -> list[str]:
    """The prompt's parts in order: instruction, one part per document, question part."""
    documents = [PART_PREFIX + doc for doc in example["documents"]]
    return [example["instruction"], *documents,
            QUESTION_TEMPLATE.format(question=example["question"])]


def build_prompt(example: dict, separator: str = DEFAULT_SEPARATOR) -> str:
    """``instruction SEP doc1 SEP ... SEP question-part``; the answer follows after a space."""
    return separator.join(prompt_parts(example))


def build_training_text(example: dict, eos_token: str = EOS_TOKEN) -> str:
    """The prompt without separators, then `` answer`` and the end-of-text token."""
    return "".join(prompt_parts(example)) + " " + example["answer"] + eos_token


def to_json_line(example: dict) -> str:
    """One JSONL line; stable key order and escaping make the bytes reproducible."""
    return json.dumps(example, ensure_ascii=False, separators=(", ", ": ")) + "\n"


def read_jsonl(path: str | Path) -> list[dict]:
    """All examples of a JSONL file."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_split(path: Path, examples: Iterable[dict]) -> int:
    """Write ``examples`` to ``path`` as JSONL; returns how many were written."""
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for example in examples:
            handle.write(to_json_line(example))
            count += 1
    return count


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m hypic_data.synthetic_qa",
        description="Generate the synthetic multi-document QA dataset (invented entities, "
                    "single-hop and two-document bridge questions, distractor documents) as "
                    "train.jsonl, validation.jsonl and test.jsonl. The same options always "
                    "produce byte-identical files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("datasets/synthetic_qa"),
                        help="output directory (created if missing)")
    parser.add_argument("--train", type=int, default=10000, help="number of train examples")
    parser.add_argument("--validation", type=int, default=500, help="number of validation examples")
    parser.add_argument("--test", type=int, default=1000, help="number of test examples")
    parser.add_argument("--seed", type=int, default=1234,
                        help="base seed; each split and example derives its own stream from it")
    parser.add_argument("--min-docs", type=int, default=4, help="fewest documents per example")
    parser.add_argument("--max-docs", type=int, default=12, help="most documents per example")
    parser.add_argument("--multi-hop-fraction", type=float, default=0.5,
                        help="probability that an example is a two-document bridge question")
    parser.add_argument("--extra-questions", type=int, default=0,
                        help="add up to N more valid questions about the same documents to "
                             "each example (field extra_questions; a training aid, 0: none)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes drawing examples (the files are the same for any count)")
    parser.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS),
                        help="splits to write, e.g. --splits test for the evaluations alone; each split "
                             "has its own seeded streams, so its file is the same whichever others are "
                             "written, and files of splits left out are not touched")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the command line."""
    from tqdm import tqdm  # only the CLI needs a progress bar

    args = _parse_args(argv)
    if not 1 <= args.min_docs <= args.max_docs:
        raise SystemExit("need 1 <= --min-docs <= --max-docs")
    config = GeneratorConfig(seed=args.seed, min_docs=args.min_docs, max_docs=args.max_docs,
                             multi_hop_fraction=args.multi_hop_fraction,
                             extra_questions=args.extra_questions)
    args.out.mkdir(parents=True, exist_ok=True)
    counts = {"train": args.train, "validation": args.validation, "test": args.test}
    chosen = [split for split in SPLITS if split in args.splits]  # the usual order, each once
    for split in chosen:
        examples = tqdm(generate_split(config, split, counts[split], args.workers), total=counts[split],
                        desc=split, unit="ex", file=sys.stderr)
        write_split(args.out / f"{split}.jsonl", examples)
    written = ", ".join(f"{counts[split]} {split}" for split in chosen)
    print(f"wrote {written} examples to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
