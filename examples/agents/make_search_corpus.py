"""Write a synthetic two-hop retrieval task: a document corpus and questions over it.

Invented countries, cities, people and companies (made-up names a model cannot know), one
document per entity, each holding a few of its attributes. Every question needs two
retrievals: the document of the entity it names gives a second entity (the bridge), and the
bridge's document holds the answer, e.g. "In which city was the founder of Korvane Labs
born?": Korvane Labs' document names its founder, the founder's document their birth city.
No document names both the question's entity and the answer.

Files written into ``out_dir`` (one JSON object per line):

- ``corpus.jsonl``: ``{"id", "title", "text"}``, one document per entity.
- ``train.jsonl`` / ``test.jsonl``: ``{"question", "answer", "kind", "docs"}``, where
  ``docs`` are the ids of the two documents the answer takes, in the order they are needed.

The same seed writes the same files::

    python examples/agents/make_search_corpus.py examples/agents/search_data
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

ONSETS = "b d f g k l m n p r s t v z br dr gr kr tr st th sh".split()
VOWELS = "a e i o u ai ei ou".split()
CODAS = ["", "", "n", "r", "l", "s", "th", "nd", "x"]
COMPANY_SUFFIXES = ["Labs", "Systems", "Works", "Group", "Foundry", "Dynamics", "Partners"]
INDUSTRIES = ["robotics", "shipping", "textile", "software", "mining", "biotech", "aerospace"]
PROFESSIONS = ["architect", "chemist", "sculptor", "economist", "surgeon", "pilot", "poet"]
CURRENCIES = ["crown", "mark", "florin", "talent", "ducat", "shilling", "real", "peso"]
RIVERS = ["north", "south", "east", "west"]
KINDS = ("founder_city", "founder_year", "hq_country", "birth_country", "city_currency")


@dataclass
class World:
    """The invented entities and their attributes (the corpus and questions derive from it).

    Each attribute maps an entity name to a value; ``founder``, ``hq``, ``birth_city`` and
    ``country`` point at other entities.
    """

    countries: list[str] = field(default_factory=list)
    cities: list[str] = field(default_factory=list)
    people: list[str] = field(default_factory=list)
    companies: list[str] = field(default_factory=list)
    attrs: dict[str, dict] = field(default_factory=dict)


def _words(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct capitalised pseudo-words of 2-3 syllables."""
    seen: set[str] = set()
    out = []
    while len(out) < count:
        word = "".join(
            rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
            for _ in range(rng.randint(2, 3))
        )
        if len(word) <= 10 and word not in seen:
            seen.add(word)
            out.append(word.capitalize())
    return out


def make_world(rng: random.Random, countries: int, cities: int, people: int, companies: int):
    """Entities with attributes; every name word is used by one entity only.

    Raises
    ------
    ValueError
        Fewer people than companies (each company has its own founder), or a count < 1.
    """
    if min(countries, cities, people, companies) < 1:
        raise ValueError("every entity count must be >= 1")
    if people < companies:
        raise ValueError(f"people = {people} must be >= companies = {companies}")
    # names, then a language per country and a river per city
    words = iter(_words(rng, 2 * (countries + cities + people) + companies))
    w = World()
    w.countries = [next(words) + "ia" for _ in range(countries)]
    w.cities = [next(words) for _ in range(cities)]
    w.people = [f"{next(words)} {next(words)}" for _ in range(people)]
    w.companies = [f"{next(words)} {rng.choice(COMPANY_SUFFIXES)}" for _ in range(companies)]
    for i, c in enumerate(w.countries):
        w.attrs[c] = {"currency": CURRENCIES[i % len(CURRENCIES)], "lang": next(words) + "ish"}
    for i, c in enumerate(w.cities):
        # every country gets a city first, so each country is reachable
        country = w.countries[i] if i < countries else rng.choice(w.countries)
        w.attrs[c] = {"country": country, "river": rng.choice(RIVERS) + " " + next(words)}
    for p in w.people:
        w.attrs[p] = {
            "birth_city": rng.choice(w.cities),
            "year": rng.randint(1920, 1990),
            "profession": rng.choice(PROFESSIONS),
        }
    for company, founder in zip(w.companies, rng.sample(w.people, companies)):
        born = w.attrs[founder]
        # the company's document must not already hold a founder question's answer
        hq = rng.choice([c for c in w.cities if c != born["birth_city"]] or w.cities)
        year = rng.choice([y for y in range(1950, 2020) if y != born["year"]])
        w.attrs[company] = {
            "founder": founder,
            "hq": hq,
            "year": year,
            "industry": rng.choice(INDUSTRIES),
        }
    return w


def documents(w: World) -> list[dict]:
    """One ``{"id", "title", "text"}`` document per entity of ``w``."""
    docs = []
    for i, c in enumerate(w.countries):
        a = w.attrs[c]
        text = f"{c} is a country. Its currency is the {a['currency']} and its people speak "
        docs.append({"id": f"country-{i}", "title": c, "text": text + f"{a['lang']}."})
    for i, c in enumerate(w.cities):
        a = w.attrs[c]
        text = f"{c} is a city in {a['country']}, on the banks of the {a['river']} river."
        docs.append({"id": f"city-{i}", "title": c, "text": text})
    for i, p in enumerate(w.people):
        a = w.attrs[p]
        text = f"{p} is a {a['profession']}, born in {a['year']} in the city of {a['birth_city']}."
        docs.append({"id": f"person-{i}", "title": p, "text": text})
    for i, c in enumerate(w.companies):
        a = w.attrs[c]
        text = (
            f"{c} is a {a['industry']} company founded in {a['year']} by {a['founder']}. "
            f"Its headquarters are in {a['hq']}."
        )
        docs.append({"id": f"company-{i}", "title": c, "text": text})
    return docs


def questions(w: World, ids: dict[str, str]) -> list[dict]:
    """Every two-hop question of ``w``; ``ids`` maps an entity name to its document id."""
    out = []

    def add(kind: str, question: str, answer, first: str, second: str) -> None:
        row = {"question": question, "answer": str(answer), "kind": kind}
        out.append({**row, "docs": [ids[first], ids[second]]})

    for c in w.companies:
        a = w.attrs[c]
        founder = w.attrs[a["founder"]]
        q = f"In which city was the founder of {c} born?"
        add("founder_city", q, founder["birth_city"], c, a["founder"])
        q = f"In which year was the founder of {c} born?"
        add("founder_year", q, founder["year"], c, a["founder"])
        q = f"In which country are the headquarters of {c}?"
        add("hq_country", q, w.attrs[a["hq"]]["country"], c, a["hq"])
    for p in w.people:
        city = w.attrs[p]["birth_city"]
        q = f"In which country was {p} born?"
        add("birth_country", q, w.attrs[city]["country"], p, city)
    for c in w.cities:
        country = w.attrs[c]["country"]
        q = f"What is the currency of the country in which {c} lies?"
        add("city_currency", q, w.attrs[country]["currency"], c, country)
    return out


def write_task(out_dir: Path, seed: int = 0, test_size: int = 40, **counts) -> dict:
    """Write ``corpus.jsonl``, ``train.jsonl`` and ``test.jsonl`` into ``out_dir``.

    Parameters
    ----------
    out_dir : Path
        Created if missing; existing files of these names are replaced.
    seed : int
        The same seed (and counts) writes byte-identical files.
    test_size : int
        Questions held out in ``test.jsonl``; the rest go to ``train.jsonl``.
    **counts
        ``countries``, ``cities``, ``people``, ``companies`` (defaults 6, 24, 80, 60).

    Returns
    -------
    dict
        Rows written per file, e.g. ``{"corpus": 170, "train": 284, "test": 40}``.

    Raises
    ------
    ValueError
        ``test_size`` is not below the number of questions, or bad entity counts.
    """
    sizes = {"countries": 6, "cities": 24, "people": 80, "companies": 60, **counts}
    rng = random.Random(seed)
    world = make_world(rng, **sizes)
    docs = documents(world)
    rows = questions(world, {d["title"]: d["id"] for d in docs})
    if not 0 <= test_size < len(rows):
        raise ValueError(f"test_size = {test_size} must be in [0, {len(rows)}) questions")
    rng.shuffle(rows)
    splits = {"corpus": docs, "train": rows[test_size:], "test": rows[:test_size]}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, items in splits.items():
        lines = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
        (out_dir / f"{name}.jsonl").write_text(lines, encoding="utf-8")
    return {name: len(items) for name, items in splits.items()}


def main(argv: list[str] | None = None) -> None:
    """Command line: ``make_search_corpus.py OUT_DIR [--seed N] [--test-size N] [...]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder for corpus/train/test.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-size", type=int, default=40)
    for name, default in (("countries", 6), ("cities", 24), ("people", 80), ("companies", 60)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    counts = {k: getattr(args, k) for k in ("countries", "cities", "people", "companies")}
    try:
        written = write_task(args.out_dir, args.seed, args.test_size, **counts)
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:  # an output folder that cannot be made or written
        parser.error(f"out_dir {str(args.out_dir)!r}: {exc.strerror or exc}")
    print(", ".join(f"{name}.jsonl: {n} rows" for name, n in written.items()))


if __name__ == "__main__":
    main()
