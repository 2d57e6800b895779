"""Mutated specs never crash the front end: a valid Program or an EmbarkError, nothing else.

Mutations work on the token level (delete, duplicate, swap, replace with another token
of the language) and on the byte level (random bytes spliced in). The formatter gets the
same inputs: it either raises EmbarkError or returns text that parses again.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embarkc import ir
from embarkc.diagnostics import EmbarkError
from embarkc.format import format_text
from embarkc.frontend import load_program_text
from embarkc.syntax import check_text

ROOT = Path(__file__).resolve().parent.parent
TINY = (ROOT / "specs" / "tiny.embark").read_text()
CONSTRAINED = """\
hardware { preset dgx_h100 nodes 2 hbm 8 GiB }
defaults { dim 64 optimizer adagrad { lr 0.01 } access zipf(1.1, sorted) }
tables t[0..7] { rows 4M hotness 2 }
table u { rows 1000 dim 12 hotness mean 3 max 9 pooling mean weighted }
feature v { table t3 hotness 1 pooling concat }
model { batch 4096 bottom_mlp [64, 32] interaction dcnv2 { layers 2 low_rank 64 } top_mlp [1] }
plan {
  solver greedy time_limit 2 min seed 3 memory_headroom 1 GiB communication hierarchical
  table t[0..1] { cluster rb row_shards 2..4 column_shards ..2 within_node }
  table u { cluster dp }
  colocate t2, t3
}
"""
SEEDS = [TINY, CONSTRAINED]
TOKEN = re.compile(
    r'"[^"\n]*"|#[^\n]*|[A-Za-z_][A-Za-z0-9_/-]*|-?[0-9][0-9_.eE+-]*[KMB]?|\.\.|\s+|.'
)
VOCAB = sorted(
    {t for s in SEEDS for t in TOKEN.findall(s) if not t.isspace()}
    | {"{", "}", "(", ")", "[", "]", ",", "..", "0", "-1", "1e400", "9" * 40, '"', "#"}
)

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def _mutate(tokens: list[str], ops: list[tuple[int, int, int, str]]) -> str:
    toks = list(tokens)
    for kind, i, j, word in ops:
        if not toks:
            break
        i %= len(toks)
        j %= len(toks)
        if kind == 0:
            del toks[i]
        elif kind == 1:
            toks.insert(i, toks[i])
        elif kind == 2:
            toks[i], toks[j] = toks[j], toks[i]
        else:
            toks[i] = f" {word} "
    return "".join(toks)


def _must_be_clean(text: str) -> None:
    try:
        program = load_program_text(text, "<fuzz>")
    except EmbarkError as e:
        assert e.diagnostics and "Traceback" not in e.render()
    else:
        assert isinstance(program, ir.Program)
        ir.Program.model_validate(program.model_dump())
    try:
        out = format_text(text, "<fuzz>")
    except EmbarkError:
        return
    assert format_text(out, "<fuzz>") == out


ops = st.lists(
    st.tuples(
        st.integers(0, 3), st.integers(0, 10_000), st.integers(0, 10_000), st.sampled_from(VOCAB)
    ),
    min_size=1,
    max_size=4,
)


@FUZZ
@given(seed=st.sampled_from(SEEDS), mutations=ops)
def test_token_mutations_never_crash(seed: str, mutations: list) -> None:
    _must_be_clean(_mutate(_tokens(seed), mutations))


@FUZZ
@given(
    seed=st.sampled_from(SEEDS), at=st.integers(0, 10_000), junk=st.binary(min_size=1, max_size=16)
)
def test_random_bytes_never_crash(seed: str, at: int, junk: bytes) -> None:
    data = seed.encode()
    at %= len(data)
    data = data[:at] + junk + data[at:]
    try:
        text = check_text(data, "<fuzz>")
    except EmbarkError:
        return
    _must_be_clean(text)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.text(max_size=200))
def test_arbitrary_text_never_crashes(text: str) -> None:
    _must_be_clean(text)


def test_unmutated_seeds_are_valid() -> None:
    for seed in SEEDS:
        assert isinstance(load_program_text(seed, "<fuzz>"), ir.Program)
