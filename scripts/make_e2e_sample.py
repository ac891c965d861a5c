#!/usr/bin/env python3
"""Write examples/data/e2e_sample.csv: a small SYNTHETIC stand-in for the E2E NLG data set.

The file is written by this project from templates, not taken from the real E2E data (Novikova et
al. 2017, https://github.com/tuetschek/e2e-dataset, ~42k training rows). It has the E2E format (a
header ``mr,ref``; ``mr`` in the E2E syntax ``slot[value], slot[value]``, slots in E2E order, ``name``
always present, 3 to 8 slots) so the GPT-2 example and the tests run without the download. The
output is deterministic (``random.Random(0)``): rerunning this script rewrites the same bytes.

Usage: python scripts/make_e2e_sample.py [OUT.csv]
"""

from __future__ import annotations

import csv
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "data" / "e2e_sample.csv"
ROWS = 60
SLOTS = {  # E2E order
    "name": ("The Eagle", "The Mill", "Aromi", "Zizzi", "Cotto", "Giraffe", "The Punter", "Fitzbillies",
             "Wildwood", "Strada"),
    "eatType": ("coffee shop", "pub", "restaurant"),
    "food": ("French", "Italian", "English", "Japanese", "Chinese", "Fast food", "Indian"),
    "priceRange": ("cheap", "moderate", "high", "less than £20", "£20-25", "more than £30"),
    "customer rating": ("low", "average", "high", "1 out of 5", "3 out of 5", "5 out of 5"),
    "area": ("riverside", "city centre"),
    "familyFriendly": ("yes", "no"),
    "near": ("Burger King", "Café Rouge", "The Bakers", "Raja Indian Cuisine"),
}


def sample_mr(rng: random.Random) -> dict[str, str]:
    """A name plus 2..7 other slots (3..8 in all), each with a random value."""
    others = [s for s in SLOTS if s != "name"]
    chosen = set(rng.sample(others, rng.randint(2, len(others))))
    return {s: rng.choice(v) for s, v in SLOTS.items() if s == "name" or s in chosen}


def mr_string(mr: dict[str, str]) -> str:
    return ", ".join(f"{s}[{v}]" for s, v in mr.items())


def _price(v: str) -> str:
    return f"{v} prices" if v in ("cheap", "moderate", "high") else f"prices {v}" if " " in v else f"prices in the {v} range"


def _rating(v: str) -> str:
    if v in ("low", "average", "high"):
        return f"{'an' if v == 'average' else 'a'} {v} customer rating"
    return f"a customer rating of {v}"


def sentence(mr: dict[str, str], rng: random.Random) -> str:
    """A fluent reference that mentions every slot of ``mr`` (one of three layouts)."""
    name, kind = mr["name"], mr.get("eatType", "place")
    food = {"": "", "Fast food": "fast food"}.get(mr.get("food", ""), f"{mr.get('food')} food")
    area = {"": "", "riverside": "by the riverside", "city centre": "in the city centre"}[mr.get("area", "")]
    where = " ".join(p for p in (area, f"near {mr['near']}" if "near" in mr else "") if p)
    has = [f(mr[s]) for s, f in (("priceRange", _price), ("customer rating", _rating)) if s in mr]
    fam = {"yes": "family-friendly ", "no": ""}.get(mr.get("familyFriendly", ""), "")
    no_kids = mr.get("familyFriendly") == "no"
    layout = rng.randrange(3)
    if layout == 0:
        out = f"{name} is a {fam}{kind}" + (f" serving {food}" if food else "") + (f" {where}" if where else "") + "."
    elif layout == 1:
        out = (f"Located {where}, " if where else "") + f"{name} is a {fam}{kind}" + \
              (f" that serves {food}" if food else "") + "."
    else:
        out = (f"For {food}, try {name}, a {fam}{kind}" if food else f"Try {name}, a {fam}{kind}") + \
              (f" {where}" if where else "") + "."
    if has:
        out += f" It has {' and '.join(has)}."
    if no_kids:
        out += " It is not family-friendly." if layout != 1 else " Children are not welcome."
    return out[0].upper() + out[1:]


def rows(seed: int = 0, n: int = ROWS) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        mr = sample_mr(rng)
        out.append((mr_string(mr), sentence(mr, rng)))
    return out


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(("mr", "ref"))
        w.writerows(rows())
    return out


if __name__ == "__main__":
    print(main())
