"""Held-out customer-service chats for the memory benchmark (``bench_memory.py --chats``).

A chat is generated from templates with a seed: short rounds (a user message, an assistant
reply) full of values of the same type as the fact asked for (other 6-digit numbers, codes
like ``AB-1234``, names, prices, dates), the fact at a depth of 10-90 % of the tokens, then
the question(s). Each chat is rendered twice from the same messages:

* ``chatml``: the model's own chat template (``tokenizer.apply_chat_template``); a round's
  token ids are the template over the messages up to that round minus the template up to
  the round before (the template is checked to be prefix-stable). SmolLM2's template adds
  its default system turn ("You are a helpful AI assistant named SmolLM ...") before the
  first user turn: it is part of the first round.
* ``plain``: ``User: ...`` / ``Assistant: ...`` lines, one exchange a round.

Families: ``a`` one fact asked at the end; ``b`` three facts of three types, each asked in
its own question; ``c`` a fact corrected later ("Sorry, it is ..."): the newer value is
correct, the older one is *stale*; ``d`` the session is closed and resumed through a fresh
router over the same mount between the fact and the question; ``e`` the session is forked
there and the question asked in the fork. (``d`` and ``e`` are ``a`` chats with a break
point: the caller does the resume or fork.)

The split is fixed here, so that defaults are chosen on one set and reported on another:

* **dev**: domains ``shop`` and ``bank``; 6-digit numbers 100000-499999, codes with letters
  A-M, the ``DEV_NAMES``, prices $10-$299, dates January-June; seeds 0-99,999.
* **test**: domains ``travel`` and ``telecom``; numbers 500000-999999, codes with letters
  N-Z, the ``TEST_NAMES``, prices $300-$999, dates July-December; seeds from 1,000,000.

No value, domain or template sentence is shared between the two.

:func:`score` judges any such answer, not only these templates': expected and answer are
compared as runs of letters and digits, case-insensitive, ignoring separators (``482 913``,
``482,913`` and ``482913`` are the same number; ``4829131`` is not), in the answer's first
lines.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

KINDS = ("number", "code", "name", "price", "date")
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
DEV_NAMES = ["Oliver Grant", "Maya Fischer", "Samuel Ortiz", "Hannah Kowalski", "Ethan Brooks",
             "Chloe Nakamura", "Lucas Moreau", "Zoe Lindqvist", "Noah Ferreira", "Ava Thompson",
             "Isaac Duval", "Ruby Hartmann", "Leo Castillo", "Emma Sorensen", "Owen Patel",
             "Iris Bennett"]
TEST_NAMES = ["Julian Weber", "Clara Novak", "Mateo Silva", "Freya Olsen", "Adrian Kovac",
              "Nora Haddad", "Felix Romano", "Lena Schubert", "Hugo Almeida", "Alice Marchetti",
              "Tobias Keller", "Sara Jovanovic", "Victor Lang", "Elsa Moretti", "Daniel Szabo",
              "Ines Carvalho"]


@dataclass(frozen=True)
class Split:
    domains: tuple[str, ...]
    numbers: tuple[int, int]
    letters: str
    names: tuple[str, ...]
    dollars: tuple[int, int]
    months: tuple[str, ...]
    seed0: int


SPLITS = {
    "dev": Split(("shop", "bank"), (100000, 499999), "ABCDEFGHJKLM", tuple(DEV_NAMES), (10, 299),
                 tuple(MONTHS[:6]), 0),
    "test": Split(("travel", "telecom"), (500000, 999999), "NPQRSTUVWXYZ", tuple(TEST_NAMES),
                  (300, 999), tuple(MONTHS[6:]), 1_000_000),
}
SEEDS_PER_SPLIT = 100_000

# Per domain and kind: the fact's noun, then the nouns of its same-type distractors.
NOUNS: dict[str, dict[str, list[str]]] = {
    "shop": {"number": ["order number", "invoice number", "item number", "return number", "parcel number"],
             "code": ["coupon code", "gift card code", "store code", "warranty code"],
             "name": ["courier's name", "cashier's name", "seller's name", "store manager's name"],
             "price": ["refund amount", "shipping fee", "sale price", "restocking fee"],
             "date": ["delivery date", "purchase date", "return deadline", "restock date"]},
    "bank": {"number": ["account number", "card number ending", "branch number", "cheque number", "loan number"],
             "code": ["transfer reference", "branch code", "statement code", "promo code"],
             "name": ["advisor's name", "teller's name", "payee's name", "branch manager's name"],
             "price": ["transfer amount", "monthly fee", "overdraft charge", "deposit amount"],
             "date": ["payment date", "statement date", "card expiry date", "appointment date"]},
    "travel": {"number": ["booking number", "ticket number", "frequent flyer number", "room number",
                          "voucher number"],
               "code": ["confirmation code", "gate code", "seat code", "baggage tag code"],
               "name": ["passenger name", "hotel contact's name", "guide's name", "driver's name"],
               "price": ["fare", "baggage fee", "hotel deposit", "upgrade price"],
               "date": ["departure date", "return date", "check-in date", "visa date"]},
    "telecom": {"number": ["customer number", "ticket number", "contract number", "modem serial number",
                           "port request number"],
                "code": ["SIM activation code", "plan code", "router code", "unlock code"],
                "name": ["technician's name", "account holder's name", "agent's name", "installer's name"],
                "price": ["bill amount", "roaming charge", "plan price", "device installment"],
                "date": ["installation date", "billing date", "contract end date", "upgrade date"]},
}
# Opening line and small talk per domain; {v} slots take distractor values of any kind.
OPENING = {
    "shop": ("Hello, I need some help with an online purchase.", "Of course! I am happy to help with your purchase."),
    "bank": ("Hi, I have a question about my bank account.", "Certainly, I can help with your account today."),
    "travel": ("Hello, I want to check a trip I booked.", "Sure, I can help you with your trip."),
    "telecom": ("Hi, I am calling about my phone and internet service.", "Happy to help with your service."),
}
SMALL = {
    "shop": [("Do you ship on weekends?", "We ship Monday to Saturday."),
             ("Can I change the color of the jacket?", "Yes, as long as it has not shipped yet."),
             ("Is the blue kettle still in stock?", "It is in stock at the moment."),
             ("How do I pay with a voucher?", "You enter it at checkout before paying."),
             ("Can I pick it up in the store instead?", "Yes, store pickup is free."),
             ("Does the blender come with a warranty?", "It has a two-year warranty."),
             ("Can you wrap it as a gift?", "Gift wrapping is available at checkout.")],
    "bank": [("Are you open on Saturday mornings?", "Our branches open at nine on Saturdays."),
             ("Can I set up a standing order online?", "Yes, in the payments section of the app."),
             ("Is there a fee for foreign cash withdrawals?", "That depends on your account type."),
             ("How do I freeze my card?", "You can freeze it in the app under card settings."),
             ("Can I open a savings account for my son?", "Yes, with his ID and yours."),
             ("Do you offer paper statements?", "Paper statements can be ordered in the app."),
             ("How long does a transfer abroad take?", "Usually one to three working days.")],
    "travel": [("Is breakfast included at the hotel?", "Breakfast is included for every night."),
               ("Can I bring my bicycle on the train?", "Bicycles need a separate reservation."),
               ("How early should I be at the airport?", "Two hours before departure is best."),
               ("Is there a shuttle from the station?", "A shuttle leaves every half hour."),
               ("Can I choose a window seat?", "Seat choice opens a day before the trip."),
               ("Do I need travel insurance?", "It is optional but recommended."),
               ("Can I cancel the rental car later?", "Free cancellation ends two days before pickup.")],
    "telecom": [("Why is my internet slow in the evening?", "Evening peaks can slow the line a little."),
                ("Can I keep my phone number if I switch plans?", "Yes, your number stays the same."),
                ("Does the plan include calls abroad?", "Calls abroad are billed separately."),
                ("How do I restart the router?", "Unplug it for thirty seconds, then plug it in."),
                ("Is there coverage in the mountains?", "Coverage is limited in remote valleys."),
                ("Can I add a second SIM for my tablet?", "Yes, a data SIM can be added."),
                ("When will fiber reach my street?", "The rollout map in the app shows the dates.")],
}
# Sentences: {n} a noun, {v} a value. Each split's domains use their own wording.
STATE = {"dev": ["My {n} is {v}.", "The {n} is {v}, by the way.", "For reference, my {n} is {v}."],
         "test": ["Please note that my {n} is {v}.", "I have it here: the {n} is {v}.",
                  "Just so you know, the {n} is {v}."]}
ACK = {"dev": ["Thank you, I have noted the {n} {v}.", "Got it, {v} is the {n}.", "Thanks, let me check that."],
       "test": ["Understood, the {n} is {v}.", "Noted: {v} for the {n}.", "Thanks, one moment please."]}
DISTRACT = {"dev": ["The {n} on my receipt says {v}.", "I also see a {n} of {v}.", "Is the {n} {v} relevant?"],
            "test": ["My email also mentions a {n}, {v}.", "There is a {n} listed as {v}.",
                     "Should I worry about the {n} {v}?"]}
DISTRACT_ACK = {"dev": ["That {n} is not needed right now.", "I see, {v} is the {n}.", "No, that one is not relevant."],
                "test": ["That is fine, {v} is only the {n}.", "You can ignore the {n} for now.",
                         "That one does not matter here."]}
CORRECT = {"dev": "Sorry, I made a mistake: my {n} is actually {v}, not {old}.",
           "test": "Apologies, I got that wrong. The {n} is in fact {v}, not {old}."}
CORRECT_ACK = {"dev": "No problem, I have updated the {n} to {v}.", "test": "Thanks, I corrected the {n} to {v}."}
QUESTION = {"dev": "Can you remind me what my {n} is?", "test": "What was the {n} I gave you earlier?"}
PREFIX = "The {n} is"
MAX_TOKENS = 2040  # SmolLM2's context is 2,048
ANSWER_ROOM = 12  # generated tokens per question
DEPTHS = tuple(round(0.1 + 0.1 * i, 1) for i in range(9))  # 10 % ... 90 %


@dataclass
class Question:
    """One question: its text, the answer's forced prefix, the correct value(s) and the
    stale ones (family c)."""

    text: str
    prefix: str
    want: list[str]
    stale: list[str] = field(default_factory=list)


@dataclass
class Chat:
    """A generated conversation: the exchanges (user, assistant) before the questions, the
    questions, and where each fact sits (index of its exchange, depth as a share of tokens)."""

    name: str
    split: str
    domain: str
    family: str
    target: int
    exchanges: list[tuple[str, str]]
    questions: list[Question]
    fact_rounds: list[int]
    depths: list[float] = field(default_factory=list)
    break_after: int | None = None  # d/e: resume or fork after this exchange
    values: list[str] = field(default_factory=list)  # every value written in the chat
    info: dict[str, Any] = field(default_factory=dict)


class Values:
    """Fresh values of one split, never the same twice in a chat."""

    def __init__(self, split: Split, rng: random.Random) -> None:
        self.s, self.rng = split, rng
        self.used: set[str] = set()
        self.facts: set[str] = set()

    def _one(self, kind: str) -> tuple[str, list[str]]:
        s, r = self.s, self.rng
        if kind == "number":
            v = str(r.randint(*s.numbers))
            return v, [v]
        if kind == "code":
            v = f"{r.choice(s.letters)}{r.choice(s.letters)}-{r.randint(1000, 9999)}"
            return v, [v]
        if kind == "name":
            v = r.choice(s.names)
            return v, [v]
        if kind == "price":
            v = f"${r.randint(*s.dollars)}.{r.choice(['00', '25', '49', '50', '75', '99'])}"
            return v, [v]
        m, d = r.choice(s.months), r.randint(1, 28)
        return f"{m} {d}", [f"{m} {d}", f"{d} {m}"]

    def new(self, kind: str, fact: bool = False) -> tuple[str, list[str]]:
        """(the value as written, the forms a correct answer may take): unused so far; once
        a small pool (names) runs out, a distractor may repeat one, never a fact."""
        for i in range(2000):
            v, forms = self._one(kind)
            if v not in self.used or (i >= 200 and not fact and v not in self.facts):
                self.used.add(v)
                if fact:
                    self.facts.add(v)
                return v, forms
        raise RuntimeError(f"value pool of {kind} exhausted")


def chat_seed(split: str, family: str, length: int, trial: int) -> int:
    """The seed of one chat: inside its split's range, a function of the cell and trial."""
    f = "abcde".index(family)
    return SPLITS[split].seed0 + (f * 7919 + length * 31 + trial * 104729) % SEEDS_PER_SPLIT


def plain_round(user: str, assistant: str) -> str:
    return f"User: {user}\nAssistant: {assistant}\n"


def generate(tok: Any, split: str, family: str, length: int, trial: int,
             depth: float | None = None) -> Chat:
    """Chat ``trial`` of ``family`` at about ``length`` tokens (counted as the mean of its
    plain and ChatML tokens; ChatML kept inside ``MAX_TOKENS`` with its answers), its
    (first) fact at ``depth`` (default: the trial's place in ``DEPTHS``); family b's other
    two facts at random depths of 10-90 %, family c's correction between the fact and 95 %."""
    sp = SPLITS[split]
    seed = chat_seed(split, family, length, trial)
    rng = random.Random(seed)
    domain = sp.domains[trial % len(sp.domains)]
    depth = DEPTHS[trial % len(DEPTHS)] if depth is None else depth
    vals = Values(sp, rng)
    nkinds = 3 if family == "b" else 1
    kinds = rng.sample(KINDS, nkinds)
    nouns = {k: NOUNS[domain][k][0] for k in kinds}
    facts = {k: vals.new(k, fact=True) for k in kinds}
    # the facts' exchanges, then filler until the length is reached
    fact_ex = {}
    for k in kinds:
        v = facts[k][0]
        ack = rng.choice(ACK[split])
        fact_ex[k] = (rng.choice(STATE[split]).format(n=nouns[k], v=v), ack.format(n=nouns[k], v=v))
    old = None
    if family == "c":
        k = kinds[0]
        old = facts[k]
        facts[k] = vals.new(k, fact=True)
        corr = (CORRECT[split].format(n=nouns[k], v=facts[k][0], old=old[0]),
                CORRECT_ACK[split].format(n=nouns[k], v=facts[k][0]))
    questions = [Question(QUESTION[split].format(n=nouns[k]), PREFIX.format(n=nouns[k]),
                          facts[k][1], old[1] if old is not None and k == kinds[0] else [])
                 for k in kinds]

    size = Sizer(tok)

    def filler() -> tuple[str, str]:
        if rng.random() < 0.6:  # a distractor of one of the facts' types
            k = rng.choice(kinds)
            n = rng.choice(NOUNS[domain][k][1:])
            v = vals.new(k)[0]
            return (rng.choice(DISTRACT[split]).format(n=n, v=v),
                    rng.choice(DISTRACT_ACK[split]).format(n=n, v=v))
        return rng.choice(SMALL[domain])

    fixed = [OPENING[domain], *fact_ex.values()]
    if family == "c":
        fixed.append(corr)
    used = size.start + sum(size(*e) for e in fixed)
    used += sum(size(q.text, q.prefix) + 8 for q in questions)  # answers ~8 tokens
    longest = size.chatml_start + sum(size.chatml(*e) for e in fixed)
    longest += sum(size.chatml(q.text, q.prefix) + ANSWER_ROOM for q in questions)
    fill: list[tuple[str, str]] = []
    while used < length:
        e = filler()
        if fill and e == fill[-1]:
            continue
        if longest + size.chatml(*e) > MAX_TOKENS:  # ChatML and the answers fit the context
            break
        fill.append(e)
        used += size(*e)
        longest += size.chatml(*e)
    # place each fact at its depth (by tokens): cumulative token counts of the filler
    body: list[tuple[str, str]] = [OPENING[domain], *fill]
    sizes = [size(*e) for e in body]
    total = sum(sizes) + sum(size(*e) for e in fixed[1:])
    depths = [depth] + [round(rng.uniform(0.1, 0.9), 2) for _ in kinds[1:]]
    inserts: list[tuple[float, tuple[str, str], str]] = [(d, fact_ex[k], k) for d, k in zip(depths, kinds, strict=True)]
    if family == "c":  # the correction later, between the fact and 95 %
        inserts.append((min(0.95, depth + 0.05 + rng.random() * max(0.0, 0.9 - depth)), corr, "correction"))
    order = sorted(range(len(inserts)), key=lambda i: inserts[i][0])
    placed: dict[int, int] = {}
    out: list[tuple[str, str]] = []
    cum, j = 0, 0
    for i, e in enumerate(body):
        # before the exchange whose middle passes the depth: the nearest place
        while j < len(order) and i > 0 and cum + sizes[i] / 2 >= inserts[order[j]][0] * total:
            placed[order[j]] = len(out)
            out.append(inserts[order[j]][1])
            cum += size(*inserts[order[j]][1])
            j += 1
        out.append(e)
        cum += sizes[i]
    for k in order[j:]:
        placed[k] = len(out)
        out.append(inserts[k][1])
    fact_rounds = [placed[i] for i in range(len(kinds))]
    chat = Chat(f"{split}-{family}-{length}-{trial}", split, domain, family, length, out, questions,
                fact_rounds, info={"seed": seed, "kinds": kinds})
    chat.depths = [measured_depth(size, chat, r) for r in fact_rounds]
    if family == "c":
        chat.info["correction_round"] = placed[len(kinds)]
        chat.info["correction_depth"] = measured_depth(size, chat, placed[len(kinds)])
    if family in ("d", "e"):  # the break somewhere between the fact and the question
        chat.break_after = rng.randint(fact_rounds[0], len(out) - 1)
    chat.values = [v for e in out for v in re.findall(r"\$\d+\.\d\d|[A-Z]{2}-\d{4}|\b\d{6}\b", " ".join(e))]
    return chat


class Sizer:
    """Tokens of an exchange: the mean of its plain and its ChatML rendering, so that both
    formats land near the target (ChatML spends ~4 more tokens a round, and a system turn:
    ``chatml_start``; ``start`` is half of it)."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.chatml_start, self._sys = tok, 0, None
        if getattr(tok, "chat_template", None):
            e1, e2 = ("a", "b"), ("c", "d")
            one = len(_template(tok, _messages([e1])))
            second = len(_template(tok, _messages([e1, e2]))) - one
            self._sys = len(_template(tok, _messages([e2]))) - second
            self.chatml_start = self._sys
        self.start = self.chatml_start // 2

    def plain(self, user: str, assistant: str) -> int:
        return len(self.tok.encode(plain_round(user, assistant), add_special_tokens=False))

    def chatml(self, user: str, assistant: str) -> int:
        if self._sys is None:
            return self.plain(user, assistant)
        return len(_template(self.tok, _messages([(user, assistant)]))) - self._sys

    def __call__(self, user: str, assistant: str) -> int:
        return (self.plain(user, assistant) + self.chatml(user, assistant) + 1) // 2


def measured_depth(size: Sizer, chat: Chat, r: int) -> float:
    """Where exchange ``r`` starts, as a share of the chat's tokens before the questions."""
    sizes = [size(*e) for e in chat.exchanges]
    return round((size.start + sum(sizes[:r])) / (size.start + sum(sizes)), 3)


def chats(tok: Any, split: str, families: Sequence[str], lengths: Sequence[int], trials: int,
          first: int = 0) -> list[Chat]:
    """Chats ``first`` .. ``first + trials - 1`` of every cell (a run split over processes
    takes a range each)."""
    return [generate(tok, split, f, n, t) for f in families for n in lengths
            for t in range(first, first + trials)]


# --- rendering --------------------------------------------------------------------------------

@dataclass
class Rendered:
    """A chat as token ids: one list per exchange, then per question (the question's ids,
    the forced answer prefix's ids); ``after_answer`` goes before a question that follows a
    generated answer (it closes the assistant's turn)."""

    fmt: str
    rounds: list[list[int]]
    questions: list[tuple[list[int], list[int]]]
    after_answer: list[int]

    @property
    def tokens(self) -> int:
        return sum(map(len, self.rounds))


def _template(tok: Any, messages: list[dict[str, str]], gen: bool = False) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    ids = out["input_ids"] if not isinstance(out, list) else out
    return list(ids)


def _messages(exchanges: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    out = []
    for u, a in exchanges:
        out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return out


def render(tok: Any, chat: Chat, fmt: str) -> Rendered:
    """``chat`` in ``fmt`` (``chatml`` or ``plain``) as rounds of token ids."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    if fmt == "plain":
        rounds = [enc(plain_round(u, a)) for u, a in chat.exchanges]
        qs = [(enc(f"User: {q.text}\n"), enc(f"Assistant: {q.prefix}")) for q in chat.questions]
        return Rendered(fmt, rounds, qs, enc("\n"))
    if fmt != "chatml":
        raise ValueError(f"unknown format {fmt!r}")
    rounds, prev = [], []
    for i in range(len(chat.exchanges)):
        full = _template(tok, _messages(chat.exchanges[:i + 1]))
        if full[:len(prev)] != prev:
            raise ValueError(f"chat template is not prefix-stable at round {i}")
        rounds.append(full[len(prev):])
        prev = full
    msgs = _messages(chat.exchanges)
    qs = []
    for q in chat.questions:
        full = _template(tok, msgs + [{"role": "user", "content": q.text}], gen=True)
        if full[:len(prev)] != prev:
            raise ValueError("chat template is not prefix-stable at a question")
        qs.append((full[len(prev):], enc(q.prefix)))
    # what the template writes after an assistant's content: closes a generated answer
    probe = _template(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    head = _template(tok, [{"role": "user", "content": "x"}], gen=True) + enc("y")
    close = probe[len(head):] if probe[:len(head)] == head else enc("<|im_end|>\n")
    return Rendered(fmt, rounds, qs, close)


# --- scoring ----------------------------------------------------------------------------------

TURN = re.compile(r"\s*(<\|im_start\|>|(user|assistant|system)\s*:)", re.I)


def _runs(text: str) -> list[str]:
    return re.findall(r"[0-9a-z]+", text.lower())


def _find(runs: list[str], want: str) -> int | None:
    """Index of the first run where consecutive runs spell ``want``'s letters and digits
    exactly (separators ignored, run boundaries kept: 482913 is not found in 4829131)."""
    target = "".join(_runs(want))
    if not target:
        return None
    for i in range(len(runs)):
        s = ""
        for r in runs[i:]:
            s += r
            if s == target:
                return i
            if not target.startswith(s):
                break
    return None


def score(answer: str, want: str | Sequence[str], stale: Sequence[str] = (), lines: int = 2) -> str:
    """``correct``, ``stale`` or ``wrong``: which value the answer's first ``lines``
    non-empty lines give first; a line that opens a new turn (``User:``, ...) ends the
    answer (a plain-text model goes on writing the dialogue, with values of its own)."""
    head = []
    for ln in answer.strip().splitlines():
        if TURN.match(ln):
            break
        if ln.strip():
            head.append(ln)
    head = head[:lines]
    runs = _runs(" ".join(head))
    wants = [want] if isinstance(want, str) else list(want)
    hits = [(i, "correct") for w in wants if (i := _find(runs, w)) is not None]
    hits += [(i, "stale") for w in stale if (i := _find(runs, w)) is not None]
    return min(hits)[1] if hits else "wrong"
