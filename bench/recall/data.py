"""The labelled set of the recall-quality benchmark, generated deterministically and stored in
``bench/data/recall_cases.json`` (``python -m bench recall --regenerate`` writes it again).

A *scope* is one person's observations (their name is the scope's tag and appears in every
observation, as in a real bank where the name is the one stem everything shares). A *case* is a
new fact and the existing observation it should update (its *twin*). Kinds:

- ``paraphrase``: the fact restates its twin in other words (hand-written pairs);
- ``lexical``: the fact repeats its twin's words and adds a detail (the control: full text
  already finds these);
- ``hard_negative``: the scope also holds *decoys*, copies of the twin that differ only by a
  number, a name or a date; the fact names the twin's. The twin must still be recalled, and how
  often a decoy outranks the twin is reported.

Every other observation of a scope is filler from slot templates, so scopes grow to 50–500.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

DATA = Path(__file__).resolve().parents[1] / "data" / "recall_cases.json"
SEED = 12

# (observation it should update, the new fact in other words). {n} is the person.
PARAPHRASES: tuple[tuple[str, str], ...] = (
    ("{n} loves green tea", "{n} adores matcha"),
    ("{n} works as a software engineer at a bank", "{n} writes code for a financial institution"),
    ("{n} lives in a flat near the river", "{n}'s apartment is close to the waterfront"),
    ("{n} is allergic to peanuts", "{n} reacts badly to groundnuts"),
    ("{n} goes jogging every morning", "{n} runs at dawn daily"),
    ("{n} drives an old Volvo estate", "{n}'s car is a vintage Swedish station wagon"),
    ("{n} is learning to play the violin", "{n} takes fiddle lessons"),
    ("{n} has two cats", "{n} owns a pair of kittens"),
    ("{n} prefers working from home", "{n} likes remote work better than the office"),
    ("{n} is vegetarian", "{n} does not eat meat"),
    ("{n} is afraid of flying", "{n} gets anxious on planes"),
    ("{n} supports Arsenal", "{n} is a fan of the Gunners"),
    ("{n} speaks fluent Spanish", "{n} is at ease conversing in Castilian"),
    ("{n} hates mornings", "{n} struggles to get up early"),
    ("{n} plays chess online most evenings", "{n} spends nights on internet chess matches"),
    ("{n} is saving to buy a house", "{n} puts money aside for a home purchase"),
    ("{n} takes the bus to the office", "{n} commutes by public transport"),
    ("{n} enjoys hiking in the mountains", "{n} likes walking trails in the alps"),
    ("{n} is studying for a master's degree", "{n} is enrolled in a postgraduate programme"),
    ("{n} has a peanut butter sandwich for lunch", "{n}'s midday meal is bread with nut spread"),
    ("{n} reads science fiction novels", "{n} enjoys books about space and the future"),
    ("{n} volunteers at the animal shelter", "{n} helps out with rescued dogs on weekends"),
    ("{n} is colour blind", "{n} cannot tell red from green"),
    ("{n} wears glasses", "{n} needs spectacles to see"),
    ("{n} has a sister who is a doctor", "{n}'s sibling practises medicine"),
    ("{n} is the team lead for payments", "{n} manages the checkout engineering squad"),
    ("{n} cycles to work", "{n} rides a bike to the office"),
    ("{n} dislikes spicy food", "{n} avoids hot chilli dishes"),
    ("{n} collects vinyl records", "{n} has a large LP collection"),
    ("{n} sleeps badly", "{n} suffers from insomnia"),
    ("{n} owns a golden retriever", "{n} has a fair-haired family dog"),
    ("{n} bakes sourdough bread", "{n} makes naturally leavened loaves"),
    ("{n} is training for a marathon", "{n} prepares for a 42 km race"),
    ("{n} plays guitar in a band", "{n} is a musician in a rock group"),
    ("{n} grew up in Scotland", "{n} spent their childhood north of the border in Edinburgh"),
    ("{n} drinks coffee without sugar", "{n} takes espresso unsweetened"),
    ("{n} has a fear of spiders", "{n} panics around arachnids"),
    ("{n} works night shifts at the hospital", "{n} is on the overnight rota at the clinic"),
    ("{n} is getting married next summer", "{n}'s wedding is planned for July"),
    ("{n} recently adopted a child", "{n} became a parent through adoption"),
    ("{n} watches a lot of documentaries", "{n} streams factual films most nights"),
    ("{n} is lactose intolerant", "{n} cannot digest dairy"),
    ("{n} keeps bees in the garden", "{n} has beehives in the backyard"),
    ("{n} is writing a novel", "{n} is drafting a book of fiction"),
    (
        "{n} goes to yoga classes twice a week",
        "{n} attends stretching sessions on Tuesdays and Fridays",
    ),
    ("{n} owns an electric car", "{n} drives a battery powered vehicle"),
    ("{n} is a night owl", "{n} stays up until the small hours"),
    ("{n} prefers tea over coffee", "{n} would rather have a cuppa than an espresso"),
    ("{n} speaks at conferences about security", "{n} gives talks on cyber defence at events"),
    ("{n} is moving to Berlin", "{n} is relocating to the German capital"),
    ("{n} plays tennis on Saturdays", "{n} has a weekly match on the court every weekend"),
    ("{n} has a vegetable patch", "{n} grows tomatoes and courgettes at home"),
    ("{n} is shy in large groups", "{n} feels awkward at crowded parties"),
    ("{n} knits scarves for friends", "{n} makes woolly gifts with needles"),
    ("{n} enjoys cooking Thai food", "{n} likes preparing curries from Bangkok"),
    ("{n} swims in the lake in summer", "{n} takes open water dips when it is warm"),
    ("{n} has a mortgage with a local bank", "{n} repays a home loan to a regional lender"),
    ("{n} was promoted to senior engineer", "{n} got a step up in seniority at work"),
    ("{n} dislikes crowds", "{n} avoids busy places"),
    ("{n} plays the piano", "{n} practises on the keyboard at home"),
    ("{n} wants to visit Japan", "{n} dreams of a trip to Tokyo and Kyoto"),
    ("{n} uses a standing desk", "{n} works upright at an adjustable table"),
    ("{n} rarely drinks alcohol", "{n} is almost teetotal"),
    ("{n} takes photos of birds", "{n} photographs wildlife with feathers"),
    ("{n} meditates before bed", "{n} does mindfulness at night"),
    ("{n} is a member of a book club", "{n} meets a reading group monthly"),
    ("{n} works for a climate charity", "{n} is employed by an environmental nonprofit"),
    ("{n} rents a studio in the city centre", "{n} pays for a small downtown apartment"),
    ("{n} is a big fan of jazz", "{n} adores saxophone and swing music"),
    ("{n} builds furniture as a hobby", "{n} does woodworking in the shed"),
)

# Hard negatives: the twin, the decoys (same sentence, one detail changed) and the fact, which
# names the twin's detail. {n} is the person.
HARD_NEGATIVES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "{n} runs 5 kilometres every Sunday",
        ("{n} runs 10 kilometres every Sunday",),
        "{n} now jogs the 5 km Sunday loop faster",
    ),
    (
        "{n}'s rent is 1200 euros a month",
        ("{n}'s rent is 950 euros a month",),
        "{n}'s monthly rent of 1200 euros went up",
    ),
    (
        "{n}'s colleague Marco leads the data team",
        ("{n}'s colleague Priya leads the data team",),
        "Marco, {n}'s coworker, now heads analytics",
    ),
    (
        "{n}'s dentist appointment is on 12 March",
        ("{n}'s dentist appointment is on 21 March",),
        "{n} moved the 12 March dental visit to the afternoon",
    ),
    (
        "{n}'s daughter Emma is 7 years old",
        ("{n}'s daughter Lucy is 7 years old",),
        "Emma, {n}'s girl, just turned eight",
    ),
    (
        "{n} flies to Lisbon on 3 June",
        ("{n} flies to Lisbon on 30 June",),
        "{n}'s 3 June flight to Lisbon was rebooked",
    ),
    ("{n} has 3 siblings", ("{n} has 5 siblings",), "{n} grew up with three brothers and sisters"),
    (
        "{n}'s manager is called Sarah",
        ("{n}'s manager is called Hannah",),
        "Sarah, who manages {n}, is leaving the company",
    ),
    (
        "{n} pays 40 pounds a month for the gym",
        ("{n} pays 25 pounds a month for the gym",),
        "{n}'s 40 pound gym fee now includes classes",
    ),
    (
        "{n}'s best friend Tom lives in Leeds",
        ("{n}'s best friend Ben lives in Leeds",),
        "Tom, {n}'s closest mate, moved out of Leeds",
    ),
    (
        "{n} started the new job on 1 September 2023",
        ("{n} started the new job on 1 September 2021",),
        "{n} has been in the role since September 2023",
    ),
    (
        "{n} sleeps 6 hours a night",
        ("{n} sleeps 8 hours a night",),
        "{n} only manages six hours of rest nightly",
    ),
    (
        "{n}'s son Leo plays football",
        ("{n}'s son Max plays football",),
        "Leo, {n}'s boy, joined a soccer club",
    ),
    (
        "{n}'s flat is on the 4th floor",
        ("{n}'s flat is on the 2nd floor",),
        "{n} walks up to the fourth storey every day",
    ),
    (
        "{n} owes Anna 300 dollars",
        ("{n} owes Anna 30 dollars",),
        "{n} paid back half of the 300 dollar debt to Anna",
    ),
    (
        "{n}'s birthday is on 14 February",
        ("{n}'s birthday is on 4 February",),
        "{n} celebrates on Valentine's day, 14 February",
    ),
    (
        "{n}'s doctor is Dr Patel",
        ("{n}'s doctor is Dr Jones",),
        "Dr Patel, who treats {n}, prescribed rest",
    ),
    (
        "{n} drinks 2 cups of coffee a day",
        ("{n} drinks 5 cups of coffee a day",),
        "{n} cut back from two coffees daily",
    ),
    (
        "{n}'s lease ends in 2025",
        ("{n}'s lease ends in 2027",),
        "{n}'s tenancy expiring in 2025 will be renewed",
    ),
    (
        "{n} works with Ravi on the mobile app",
        ("{n} works with Chen on the mobile app",),
        "Ravi and {n} shipped the phone application",
    ),
    (
        "{n}'s train leaves at 7:15",
        ("{n}'s train leaves at 8:15",),
        "{n} catches the 7:15 commuter service",
    ),
    ("{n} weighs 70 kilograms", ("{n} weighs 77 kilograms",), "{n} is now just under 70 kg"),
    ("{n}'s cat Miso is 12", ("{n}'s cat Tofu is 12",), "Miso, {n}'s old tabby, needs a vet visit"),
    (
        "{n} has worked at the firm for 10 years",
        ("{n} has worked at the firm for 4 years",),
        "{n} marks a decade with the company",
    ),
)

# Filler slot templates: many distinct observations about the person.
FILLERS: tuple[str, ...] = (
    "{n} visited {place} in {month}",
    "{n}'s {relative} works as a {job}",
    "{n} bought a {color} {item} at the {shop}",
    "{n} read {book} on holiday",
    "{n} watched {film} with {friend}",
    "{n} cooked {dish} for {friend} on {day}",
    "{n} has a {appointment} appointment on {day}",
    "{n} met {friend} at the {venue}",
    "{n} wants to learn {skill}",
    "{n} fixed the {thing} in the {room}",
    "{n} lent {friend} a {item}",
    "{n} forgot the {item} at the {venue}",
    "{n} complained about the {thing} to {friend}",
    "{n} painted the {room} {color}",
    "{n}'s {relative} visited {place} in {month}",
)
SLOTS: dict[str, tuple[str, ...]] = {
    "place": (
        "Rome",
        "Oslo",
        "Porto",
        "Krakow",
        "Dublin",
        "Seville",
        "Vienna",
        "Bruges",
        "Nice",
        "Bergen",
        "Split",
        "Tallinn",
        "Lyon",
        "Ghent",
        "Riga",
    ),
    "month": ("January", "February", "April", "May", "August", "October", "November", "December"),
    "relative": (
        "uncle",
        "aunt",
        "cousin",
        "grandmother",
        "nephew",
        "niece",
        "brother-in-law",
        "stepfather",
    ),
    "job": (
        "plumber",
        "architect",
        "pharmacist",
        "pilot",
        "accountant",
        "electrician",
        "journalist",
        "lawyer",
        "nurse",
        "carpenter",
        "teacher",
        "baker",
    ),
    "color": ("blue", "yellow", "grey", "purple", "orange", "white", "black", "navy", "beige"),
    "item": (
        "umbrella",
        "lamp",
        "backpack",
        "kettle",
        "scarf",
        "drill",
        "toaster",
        "wallet",
        "jacket",
        "helmet",
        "blender",
        "rug",
        "mirror",
        "stool",
    ),
    "shop": (
        "market",
        "hardware store",
        "flea market",
        "department store",
        "charity shop",
        "outlet",
    ),
    "book": (
        "a thriller",
        "a biography",
        "a history book",
        "a poetry collection",
        "a travel guide",
        "a cookbook",
        "a graphic novel",
    ),
    "film": (
        "a horror film",
        "a comedy",
        "a western",
        "an animated film",
        "a courtroom drama",
        "a musical",
    ),
    "friend": (
        "Olga",
        "Samir",
        "Ines",
        "Pavel",
        "Greta",
        "Kofi",
        "Lena",
        "Dario",
        "Yuki",
        "Bruno",
        "Noor",
        "Elif",
    ),
    "dish": ("lasagne", "paella", "risotto", "goulash", "dumplings", "a stew", "pancakes", "a pie"),
    "day": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday"),
    "appointment": ("optician", "hairdresser", "physiotherapy", "bank", "tax advisor", "vet"),
    "venue": (
        "library",
        "station",
        "museum",
        "cinema",
        "pub",
        "bakery",
        "post office",
        "town hall",
    ),
    "skill": (
        "welding",
        "calligraphy",
        "sailing",
        "pottery",
        "archery",
        "salsa",
        "juggling",
        "Morse code",
    ),
    "thing": (
        "boiler",
        "washing machine",
        "doorbell",
        "window latch",
        "radiator",
        "fridge",
        "shower",
        "fence",
    ),
    "room": ("kitchen", "bathroom", "hallway", "attic", "cellar", "bedroom", "garage"),
}

# (person, scope size): scopes grown to 50–500 observations.
PEOPLE: tuple[tuple[str, int], ...] = (
    ("Alice", 50),
    ("Bruno", 80),
    ("Chiara", 120),
    ("Dmitri", 180),
    ("Esther", 250),
    ("Farid", 320),
    ("Greta", 400),
    ("Hiro", 500),
)
PARAPHRASES_PER_PERSON = 18
LEXICAL_PER_PERSON = 5
HARD_NEGATIVES_PER_PERSON = 6
LEXICAL_ADDITIONS = (
    "and has done so for years",
    "according to a friend",
    "as mentioned again this week",
    "which came up at dinner",
    "and talks about it often",
)


@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    scope: str
    fact: str
    twin: str
    decoys: tuple[str, ...]


def generate() -> dict[str, Any]:
    """The whole labelled set (scopes with their observations, and the cases)."""
    rng = random.Random(SEED)
    scopes: list[dict[str, Any]] = []
    cases: list[Case] = []
    for p_index, (person, size) in enumerate(PEOPLE):
        observations: list[str] = []
        # Each person gets a different slice of the pairs, so most pairs appear in 2 scopes.
        start = (p_index * PARAPHRASES_PER_PERSON) % len(PARAPHRASES)
        chosen = [
            PARAPHRASES[(start + i) % len(PARAPHRASES)] for i in range(PARAPHRASES_PER_PERSON)
        ]
        lexical = rng.sample([p for p in PARAPHRASES if p not in chosen], LEXICAL_PER_PERSON)
        hard_start = (p_index * HARD_NEGATIVES_PER_PERSON) % len(HARD_NEGATIVES)
        hard = [
            HARD_NEGATIVES[(hard_start + i) % len(HARD_NEGATIVES)]
            for i in range(HARD_NEGATIVES_PER_PERSON)
        ]
        for i, (twin, fact) in enumerate(chosen):
            twin_text = twin.format(n=person)
            observations.append(twin_text)
            cases.append(
                Case(f"{person}-p{i}", "paraphrase", person, fact.format(n=person), twin_text, ())
            )
        for i, (twin, _) in enumerate(lexical):
            twin_text = twin.format(n=person)
            observations.append(twin_text)
            fact = f"{twin_text} {LEXICAL_ADDITIONS[i % len(LEXICAL_ADDITIONS)]}"
            cases.append(Case(f"{person}-l{i}", "lexical", person, fact, twin_text, ()))
        for i, (twin, decoys, fact) in enumerate(hard):
            twin_text = twin.format(n=person)
            decoy_texts = tuple(d.format(n=person) for d in decoys)
            observations.append(twin_text)
            observations.extend(decoy_texts)
            cases.append(
                Case(
                    f"{person}-h{i}",
                    "hard_negative",
                    person,
                    fact.format(n=person),
                    twin_text,
                    decoy_texts,
                )
            )
        seen = set(observations)
        while len(observations) < size:
            template = rng.choice(FILLERS)
            text = template.format(n=person, **{k: rng.choice(v) for k, v in SLOTS.items()})
            if text not in seen:
                seen.add(text)
                observations.append(text)
        rng.shuffle(observations)
        scopes.append({"scope": person, "observations": observations})
    return {
        "seed": SEED,
        "scopes": scopes,
        "cases": [c.__dict__ | {"decoys": list(c.decoys)} for c in cases],
    }


def write(path: Path = DATA) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(generate(), option=orjson.OPT_INDENT_2) + b"\n")
    return path


def load(path: Path = DATA) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(path.read_bytes())
    return data
