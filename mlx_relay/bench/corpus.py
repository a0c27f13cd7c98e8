"""A fixed local corpus and deterministic text from it: prose prompts, code-like tool output.

Nothing is downloaded; the same generator state gives the same text on every machine. Lengths
are in words; `approx_words` converts an approximate token count (about 0.75 words a token for
English under common BPE tokenizers).
"""

from __future__ import annotations

import numpy as np

WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is that for it as with was on be by this are from at or an have not which
    but all they were we one their there been has more will would when what so if about other
    into can only time some could them these than then its also two first new any may like over
    such our after most made where through back much before good well should very just those
    because each how both being between under never same another while last might great old
    year work people world state system program data model server request token batch memory
    cache layer kernel thread queue stream answer question report result value number table
    function method class module package library version release build test check error file
    line page word letter sentence paragraph chapter story river mountain forest garden window
    door house street city country market price money bank account letter office meeting plan
    project team member leader group company customer product service support design engineer
    network signal channel message packet router switch cable power light sound music color
    picture image camera screen display keyboard mouse printer paper pencil notebook library
    school student teacher lesson course exam grade science history language number theory
    physics chemistry biology energy matter motion force field wave particle atom molecule
    planet star galaxy orbit rocket engine wheel vehicle train station airport flight ticket
    travel journey road bridge tunnel harbor island ocean coast beach desert valley canyon
    weather rain snow wind cloud storm summer winter spring autumn morning evening night
    quickly slowly carefully simply clearly nearly rarely often always sometimes usually
    small large long short high low early late young fresh bright dark warm cold quiet loud
    simple complex careful clever gentle honest patient proud strong weak rich poor busy free
    build write read send receive open close start stop move turn hold keep give take make
    find show tell ask answer explain describe compare measure count store load save copy
    merge split sort filter map reduce parse format encode decode compress expand render
    """.split()
)

CODE_WORDS: tuple[str, ...] = tuple(
    """
    self config value result items index count total buffer cursor offset length size limit
    request response client server handler worker queue batch token cache layer state path
    name key data node edge graph tree list dict text line chunk frame block stream reader
    writer parser encoder decoder model tensor shape dtype weight scale bias step score
    """.split()
)

_CODE_TEMPLATES: tuple[str, ...] = (
    "def {a}_{b}({c}, {d}):",
    "    {a} = {b}.{c}({d})",
    "    if {a} is None:",
    "        return {b}",
    "    for {a} in {b}.{c}:",
    "        {a}.append({b}[{n}])",
    "    return {a} + {n}",
    "class {A}{B}:",
    "    {a}: int = {n}",
    "# {a} {b} {c} {d}",
)

TOKENS_PER_WORD = 1.33


def approx_words(tokens: int) -> int:
    """Words that make about `tokens` tokens (at least one)."""
    return max(1, round(tokens / TOKENS_PER_WORD))


def prose(rng: np.random.Generator, n_words: int) -> str:
    """`n_words` words of sentence-shaped text: capitalized, 6 to 16 words to a sentence."""
    picks = rng.integers(0, len(WORDS), size=n_words)
    out: list[str] = []
    sentence_left = 0
    for i, k in enumerate(picks):
        word = WORDS[k]
        if sentence_left == 0:
            word = word.capitalize()
            sentence_left = int(rng.integers(6, 17))
        sentence_left -= 1
        if sentence_left == 0 or i == n_words - 1:
            word += "."
        out.append(word)
    return " ".join(out)


def code(rng: np.random.Generator, n_words: int) -> str:
    """About `n_words` words of Python-looking lines (tool results: file reads, greps)."""
    lines: list[str] = []
    words = 0
    while words < n_words:
        template = _CODE_TEMPLATES[int(rng.integers(0, len(_CODE_TEMPLATES)))]
        a, b, c, d = (CODE_WORDS[int(k)] for k in rng.integers(0, len(CODE_WORDS), size=4))
        line = template.format(a=a, b=b, c=c, d=d, A=a.capitalize(), B=b.capitalize(), n=int(rng.integers(0, 100)))
        lines.append(line)
        words += len(line.split())
    return "\n".join(lines)


def identifier(rng: np.random.Generator) -> str:
    a, b = (CODE_WORDS[int(k)] for k in rng.integers(0, len(CODE_WORDS), size=2))
    return f"{a}_{b}"
