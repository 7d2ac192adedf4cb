"""The review task: real-text prompts for an instruct model, built offline from shipped word lists.

Every prompt asks for a short review of a named item that mentions two of its aspects and ends
with a given word, e.g.

    In two short sentences, review the Blue Door Bistro (a restaurant). Mention the service and
    the dessert. The last word must be "again".

(SmolLM2-135M-Instruct ends 94% of its answers to these within 64 tokens, ~29 tokens on
average; asked for "a short review" it wrote on past 64 tokens in 98% of its samples.)

The decisions that earn reward are spread over the response: its tone everywhere, the aspects
wherever they fit, the closing word at the very end (the gold is `marl_jax.eval.review_gold`).
A prompt is a `ReviewSpec`; `review_prompts` enumerates every spec of the word lists (10
categories x 8 items x 28 aspect pairs x 5 closings = 11,200 distinct prompts), shuffles them
with a seed and cuts disjoint held-out / training parts, so no held-out prompt text is ever
trained on.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

# category -> (items, aspects). Aspects are singular nouns, matched by lemma in the gold.
CATALOGUE = {
    "restaurant": (
        ("the Blue Door Bistro", "Casa Verde", "the Golden Wok", "Luigi's Trattoria",
         "the Harbour Grill", "Saffron House", "the Corner Diner", "Sakura Garden"),
        ("service", "dessert", "menu", "price", "atmosphere", "portion", "staff", "wine")),
    "hotel": (
        ("the Riverside Inn", "the Grand Palace Hotel", "Seaview Lodge", "the Maple Court Hotel",
         "the Alpine Chalet", "City Central Suites", "the Old Mill Guesthouse",
         "Sunset Beach Resort"),
        ("room", "breakfast", "bed", "location", "pool", "staff", "view", "bathroom")),
    "phone": (
        ("the Nova X2 phone", "the Pixelon 7", "the Orbit Mini", "the Zenith Pro phone",
         "the Lumo S", "the Vertex 5G", "the Aero Lite phone", "the Kestrel One"),
        ("battery", "camera", "screen", "price", "speaker", "design", "charger", "software")),
    "laptop": (
        ("the Atlas 14 laptop", "the Featherbook Air", "the Titan Workstation",
         "the Nimbus 13", "the Ranger Pro laptop", "the Quill Ultrabook", "the Bolt 15",
         "the Harbor Chromebook"),
        ("keyboard", "battery", "screen", "fan", "trackpad", "weight", "speed", "port")),
    "book": (
        ("the novel The Silent Orchard", "the memoir Northern Lights", "the thriller Cold Harbor",
         "the novel A Map of Stars", "the cookbook Simple Suppers", "the biography The Iron Lady",
         "the fantasy novel The Ember Crown", "the mystery The Last Train"),
        ("plot", "character", "ending", "writing", "chapter", "dialogue", "cover", "pace")),
    "film": (
        ("the film Midnight Run", "the film The Long Summer", "the animated film Paper Moon",
         "the documentary Deep Blue", "the film Iron Valley", "the comedy Second Chances",
         "the film The Quiet Coast", "the thriller Night Shift"),
        ("acting", "soundtrack", "plot", "ending", "scene", "script", "cast", "camera")),
    "headphones": (
        ("the Echo Buds", "the SoundWave 300 headphones", "the Quietline ANC headphones",
         "the Pulse Sport earbuds", "the Studio Max headphones", "the AirLoop earbuds",
         "the Bassline 2 headphones", "the Calm Pro headphones"),
        ("sound", "battery", "comfort", "bass", "case", "microphone", "cable", "price")),
    "coffee shop": (
        ("Bean There Cafe", "the Daily Grind", "Copper Kettle Coffee", "the Roastery",
         "Morning Ritual Cafe", "the Velvet Cup", "Brew and Bloom", "the Little Espresso Bar"),
        ("coffee", "pastry", "barista", "music", "seat", "price", "cake", "tea")),
    "bike": (
        ("the Trailblazer 29 mountain bike", "the CityGlide commuter bike",
         "the Swift Road 2 bike", "the Folda Mini bike", "the Gravel King bike",
         "the E-Cruiser electric bike", "the Junior Rider bike", "the Tandem Twin bike"),
        ("brake", "gear", "saddle", "frame", "tyre", "weight", "light", "price")),
    "museum": (
        ("the City Art Museum", "the Museum of Flight", "the Natural History Hall",
         "the Maritime Museum", "the Science Discovery Center", "the Folk Art Gallery",
         "the Railway Museum", "the Museum of Modern Design"),
        ("exhibit", "guide", "ticket", "cafe", "painting", "staff", "shop", "map")),
}
CLOSINGS = ("again", "everyone", "today", "soon", "friends")
ASPECTS_PER_PROMPT = 2


@dataclasses.dataclass(frozen=True)
class ReviewSpec:
    """What one prompt asks for."""
    category: str
    item: str
    aspects: tuple  # ASPECTS_PER_PROMPT aspect nouns, in the order the prompt names them
    closing: str  # the word the review must end with

    @property
    def prompt(self) -> str:
        mention = " and the ".join(self.aspects)
        return (f"In two short sentences, review {self.item} (a {self.category}). Mention the "
                f"{mention}. The last word must be \"{self.closing}\".")

    def record(self) -> dict:
        """The prompt record the loaders and the gold read (`prompt` plus the spec fields)."""
        return dict(prompt=self.prompt, category=self.category, item=self.item,
                    aspects=list(self.aspects), closing=self.closing)


def all_specs() -> list[ReviewSpec]:
    """Every spec of the word lists, in a fixed order (categories, items, aspect pairs,
    closings)."""
    specs = []
    for category, (items, aspects) in CATALOGUE.items():
        for item in items:
            for pair in itertools.combinations(aspects, ASPECTS_PER_PROMPT):
                specs += [ReviewSpec(category, item, pair, c) for c in CLOSINGS]
    return specs


def spec_from_record(record: dict) -> ReviewSpec:
    """The `ReviewSpec` of a prompt record (`ReviewSpec.record`); KeyError naming a missing
    field."""
    missing = [k for k in ("category", "item", "aspects", "closing") if k not in record]
    if missing:
        raise KeyError(f"review prompt record lacks {missing}: {sorted(record)}")
    return ReviewSpec(record["category"], record["item"], tuple(record["aspects"]),
                      record["closing"])


def review_prompts(seed: int, sizes: dict) -> dict:
    """Disjoint parts of the shuffled specs, as prompt records.

    Args:
      seed: the shuffle's seed (`numpy.random.default_rng`).
      sizes: part name -> number of prompts, e.g. `{"eval": 128, "sft": 512, "rm": 512,
        "rl": 1024}`; parts are cut in this order from one permutation, so every part is
        disjoint from every other and the first part does not depend on the sizes of the rest.

    Returns:
      part name -> list of `ReviewSpec.record()` dicts.
    """
    specs = all_specs()
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(f"review_prompts: size of part {name!r} must be an integer >= 0, "
                             f"got {size!r}")
    total = sum(int(s) for s in sizes.values())
    if total > len(specs):
        raise ValueError(f"review_prompts: the parts {dict(sizes)} need {total} prompts but the "
                         f"word lists make {len(specs)} distinct ones")
    order = np.random.default_rng(seed).permutation(len(specs))
    parts, start = {}, 0
    for name, size in sizes.items():
        parts[name] = [specs[i].record() for i in order[start:start + int(size)]]
        start += int(size)
    return parts
