"""Budget fitting and the token estimator (fast: the tokenizer seam is a counting fake)."""

from __future__ import annotations

import asyncio

import pytest

from app.rag.budget import OverBudget, TokenEstimator, fit_to_budget
from app.rag.context import ContextChunk


class WordTokenizer:
    """One token per whitespace-separated word; counts its calls (the only fake: vLLM's /tokenize)."""

    def __init__(self) -> None:
        self.calls = 0

    async def tokenize(self, messages: list[dict]) -> list[int]:
        self.calls += 1
        return [0] * sum(len(m["content"].split()) for m in messages)


def chunks(n: int, words: int = 50) -> list[ContextChunk]:
    return [ContextChunk(f"d{i}::0::h", f"d{i}", 0, " ".join(["word"] * words), rank=i) for i in range(n)]


def render(kept: list[ContextChunk]) -> list[dict]:
    return [{"role": "user", "content": " ".join(c.text for c in kept) + " question"}]


def fit(llm, budget, estimator=None, n=10):
    return asyncio.run(fit_to_budget(render, llm, chunks(n), budget, lambda c: len(c.text), estimator))


def test_estimator_is_pessimistic_and_declines_until_calibrated():
    estimator = TokenEstimator()
    prompt = render(chunks(10))
    assert estimator.estimate(prompt) is None
    exact = 501  # what the server counted for this prompt
    estimator.observe(prompt, exact)
    assert estimator.estimate(prompt) >= exact
    estimator.observe([{"role": "user", "content": "x" * 100}], 100)  # a denser text lowers chars per token
    assert estimator.estimate(prompt) > exact * 4


def test_a_prompt_well_inside_the_budget_is_not_counted_again():
    estimator, llm = TokenEstimator(), WordTokenizer()
    estimator.observe(render(chunks(10)), 501)
    messages, kept, tokens = fit(llm, budget=4000, estimator=estimator)
    assert llm.calls == 0 and len(kept) == 10 and tokens >= 501


def test_near_the_limit_it_counts_exactly_and_drops_the_lowest_ranks():
    estimator, llm = TokenEstimator(), WordTokenizer()
    estimator.observe(render(chunks(10)), 501)
    messages, kept, tokens = fit(llm, budget=320, estimator=estimator)
    assert llm.calls >= 1 and tokens <= 320
    assert [c.rank for c in kept] == list(range(len(kept))) and 0 < len(kept) < 10


def test_nothing_fits_is_a_clear_error():
    with pytest.raises(OverBudget) as raised:
        fit(WordTokenizer(), budget=0)
    assert raised.value.code == "context_length_exceeded"
