"""A tail's ids composed from its pieces' ids (``app.vllm.prompt_pieces``) are exactly the tail's own, for the test
model's tokenizer (BERT WordPiece) and SmolLM2's (byte-level BPE), each with its chat template, over real prose
rendered by the service's templates; a composition that would differ is caught. Only tokenizers: no vLLM."""

from __future__ import annotations

import random

import orjson

from app.rag.context import ContextChunk, PromptBuilder
from app.rag.prompts import PromptTemplates
from app.vllm.prompt_pieces import PIECE_CHARS, Pieces, check, encode
from tests.support.corpora import paragraphs
from tests.support.env import ROOT

ODD = "ünïcode — [SEP] <s> 1,234.5 %\n\n<|im_start|> tabs\tand  double  spaces "


def contexts(count: int) -> list[list[ContextChunk]]:
    """Contexts of four real paragraphs each (units and chunks of their own alternating, one in three with
    unusual characters), every one a different set, so the pieces come in new orders and neighbours."""
    texts, rng = paragraphs(), random.Random(7)
    found = []
    for number in range(count):
        chosen = rng.sample(range(len(texts)), 4)
        found.append([ContextChunk(id=f"c{i}", doc_id=f"d{i}.md", chunk_index=0, title=f"Doc {i}",
                                   text=texts[i] + (ODD if number % 3 == 0 else ""), unit=f"d{i}.md" * (n % 2))
                      for n, i in enumerate(chosen)])
    return found


def composed(pieces: Pieces, tokenizer, tail: str, shown: list[str]) -> tuple[list[int], int]:
    """The tail's ids as a request makes them, and how many characters it tokenized."""
    cut = pieces.cut(tail, 0, shown)
    texts = cut.texts()
    fragments = cut.fragments(encode(tokenizer, texts))
    return orjson.loads(b"[" + b",".join(filter(None, fragments)) + b"]"), sum(map(len, texts))


def test_a_tail_composed_from_its_pieces_ids_is_exactly_the_tail_tokenized_whole(tokenizer):
    builder, pieces = PromptBuilder(PromptTemplates.load(ROOT / "prompts")), Pieces()
    tokenized, lengths = 0, 0
    for number, context in enumerate(contexts(60)):
        messages = builder.messages(context, f"Question {number}: what does it say about {ODD}?")
        tail = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        shown = builder.pieces(context)
        assert "".join(shown) in tail
        ids, chars = composed(pieces, tokenizer, tail, shown)
        assert ids == encode(tokenizer, [tail])[0], number
        if number >= 30:  # the pieces of earlier prompts are known: only the rest is tokenized per request
            tokenized, lengths = tokenized + chars, lengths + len(tail)
        cut = pieces.cut(tail, 0, shown)
        if cut.learns:
            learnt = check(tokenizer, cut)
            assert learnt is not None
            pieces.keep(learnt, pieces.generation)
    assert len(pieces.known) == len({p for c in contexts(60) for p in builder.pieces(c) if len(p) >= PIECE_CHARS})
    assert tokenized < 0.6 * lengths  # the system prompt and the question stay; every long piece is reused


def test_a_piece_whose_edge_the_tokenizer_merges_across_is_caught_and_not_kept(tokenizer):
    piece = "harbourquay" * 40  # one long word: the text around the cut merges with it
    tail = "Intro " + piece + "side and more words after it."
    pieces = Pieces()
    cut = pieces.cut(tail, 0, [piece])
    assert cut.learns and check(tokenizer, cut) is None
    assert not pieces.known


def test_pieces_cleared_while_a_check_ran_keep_nothing_and_kept_ids_stay_within_their_bound():
    pieces = Pieces()
    generation = pieces.generation
    pieces.clear()  # vLLM changed while a check of the old tokenizer's ids ran
    pieces.keep([(b"k" * 16, b"1,2,3")], generation)
    assert not pieces.known
    pieces.keep([(b"k" * 16, b"1,2,3")], pieces.generation)
    assert pieces.known == {b"k" * 16: b"1,2,3"} and pieces.size == 5
    pieces.turn_off()
    assert not pieces.on and not pieces.known and not pieces.claim_check(pieces.cut("x" * 300, 0, ["x" * 300]))


def test_pieces_before_the_tail_or_across_its_start_are_passed_over_and_spans_count_from_the_tail():
    first, second, third = ("<doc>" + letter * PIECE_CHARS + "</doc>\n" for letter in "abc")
    text = "system\n" + first + second + third + "Question?"
    tail_start = text.index(second) + 10  # the head's cut falls inside the second piece
    cut = Pieces().cut(text, tail_start, [first, second, third])
    assert cut.tail == text[tail_start:]
    assert [cut.tail[start:end] for start, end, *_ in cut.spans] == [third]
