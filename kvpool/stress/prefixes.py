"""--shared-prefix: prompts that share prefixes, and the prefill chunks that keep every reuse checkable.

Prompts: a few system prompts of random lengths (seeded sentences), most sessions beginning with one of them,
some with one cut at a random length (diverging from it inside a block), some with none; then a message of
their own. No prompt is a prefix of another (each ends with the same assistant turn, which no message holds),
so two prompts share whole blocks only where they share a system prompt, and a session shares its own prompt's
blocks with its earlier lives (a release and re-open, an epoch bump). A session whose prompt shares a whole block
with an earlier session's starts once that one's first append is done, so first starts reuse another session's
prefix too (when the daemons stored it by then: a warning when none did).

What is checked: each session's log is replayed alone with its appends as it made them, and a session started
from a stored prefix logs its prompt as one append (kvpool.stress.tapped_session). So the reference computes
a prompt in one chunk where the daemons took a prefix computed by whichever session stored it, in its chunks,
and computed the rest. That is exact when every stored prefix was computed in chunks of more than one row: then
any partition gives the same bits as one chunk (measured here: scripts/probe_chunking.py,
evidence/prefix/chunking-probe.txt; a one-row append does not). So in this scenario a fresh session's first
append is its whole prompt (the router reuses a prefix only there, and computes at least two rows after it),
every other prefill chunk has at least two rows and never leaves one row pending; a one-row append then lands
only on a prompt's last position (which no other prompt shares and no reuse of its own prompt reaches: the
router leaves two rows) or past the prompt (decodes: no other prompt holds those tokens).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from kvpool.local.tokenizer import Tokenizer
from kvpool.router.session import MIN_COMPUTED_ROWS

SYSTEM_SENTENCES = (
    "You are the assistant of a small lighthouse museum on a windy northern coast.",
    "Answer in one or two short sentences, in plain words a child would understand.",
    "Never invent facts: when you do not know something, say so and suggest asking the staff.",
    "When a visitor asks for a list, give at most four items, each on its own line.",
    "Use metric units, and give times in the twenty-four hour clock.",
    "Keep a calm and friendly tone, even when a visitor is rude or in a hurry.",
    "The museum opens at ten in the morning and closes at five, except on Mondays.",
    "Tickets cost eight euros for adults; children under twelve enter for free.",
    "Photography is allowed everywhere except in the room with the old lamp.",
    "If someone feels unwell, tell them to find the nearest member of staff at once.",
    "Do not discuss politics, religion or the prices of other museums.",
    "The keeper's cottage can be visited only with a guide, every hour on the hour.",
)
QUESTIONS = (
    "How tall is the lighthouse?",
    "Can I bring my dog inside?",
    "What did the keeper eat in winter?",
    "Why is the lamp red and white?",
    "Is there a cafe near the museum?",
    "How far can the light be seen at night?",
    "When was the lighthouse built?",
    "Where can I park my bicycle?",
)
SYSTEM_PROMPTS = 3  # at most; fewer with fewer sessions
MIN_SENTENCES, MAX_SENTENCES = 2, 6
MULTI_ROW_CHUNKS = (2, 3, 5, 8, 13, 16, 24)  # kvpool.stress.driver.PREFILL_CHUNKS without the one-row chunk


@dataclasses.dataclass(frozen=True, slots=True)
class SharedPrompt:
    tokens: tuple[int, ...]
    kind: str  # "system k", "system k cut at r" or "none"
    shared_tokens: int  # the longest prefix it shares with another session's prompt
    follows: int | None = None  # the first earlier session whose prompt shares a whole block it may reuse: it starts after that one's first append


def _system_prompts(tokenizer: Tokenizer, count: int, rng: random.Random) -> list[list[int]]:
    prompts = []
    for _ in range(count):
        sentences = rng.sample(SYSTEM_SENTENCES, rng.randint(MIN_SENTENCES, MAX_SENTENCES))
        prompts.append(tokenizer.encode("System: " + " ".join(sentences)))
    return prompts


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def shared_prompts(tokenizer: Tokenizer, sessions: int, seed: int, block: int) -> list[SharedPrompt]:
    """One prompt per session: of every four sessions two begin with a whole system prompt, one with a system
    prompt cut at a random length that is not a whole number of blocks, one with none; each system prompt is
    given to two sessions or more."""
    rng = random.Random(f"shared-prefix:{seed}")
    with_system = [index for index in range(sessions) if index % 4 != 3]
    systems = _system_prompts(tokenizer, max(1, min(SYSTEM_PROMPTS, len(with_system) // 2)), rng)
    built: list[tuple[list[int], str]] = []
    for index in range(sessions):
        message = f"\nUser: question {index + 1}. {QUESTIONS[index % len(QUESTIONS)]}\nAssistant:"
        system = (with_system.index(index) // 2) % len(systems) if index in with_system else 0  # two sessions (or more) to each
        match index % 4:
            case 3:
                tokens, kind = tokenizer.encode(message.lstrip()), "none"
            case 2 if len(systems[system]) > block + 1:
                cut = rng.randrange(block + 1, len(systems[system]))
                cut -= cut % block == 0 and block > 1  # diverge inside a block
                tokens, kind = systems[system][:cut] + tokenizer.encode(message, add_special=False), f"system {system} cut at {cut}"
            case _:
                tokens, kind = systems[system] + tokenizer.encode(message, add_special=False), f"system {system}"
        built.append((tokens, kind))
    prompts = []
    for index, (tokens, kind) in enumerate(built):
        others = [other for position, (other, _kind) in enumerate(built) if position != index]
        if any(_common_prefix(tokens, other) >= min(len(tokens), len(other)) for other in others):
            raise ValueError(f"prompt {index} ({kind}) is a prefix of another or has one: the scenario's premise fails")
        reusable = [position for position, (other, _kind) in enumerate(built[:index]) if min(_common_prefix(tokens, other), len(tokens) - MIN_COMPUTED_ROWS) >= block]
        shared = max((_common_prefix(tokens, other) for other in others), default=0)
        prompts.append(SharedPrompt(tuple(tokens), kind, shared, reusable[0] if reusable else None))
    return prompts


def prefill_rows(length: int, pending: int, prompt_length: int, rng: random.Random) -> int:
    """The rows of the next prefill chunk: a fresh session's whole prompt (the router looks prefixes up on its
    first append only), otherwise at least two rows and never one row left over (see the module's docstring)."""
    if length == 0:
        return min(pending, prompt_length)
    rows = min(pending, rng.choice(MULTI_ROW_CHUNKS))
    return rows + 1 if pending - rows == 1 else rows
