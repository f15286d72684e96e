"""How vLLM's event stream is read: a batch of events per network read, lines cut anywhere by the network."""

import httpx
import orjson

from app.vllm.wire import Completion, event_batches, read_event


def chat_event(text: str, finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"delta": {"content": text}, "finish_reason": finish}]}) + b"\n\n"


class Reads(httpx.AsyncByteStream):
    """The body as the network hands it over: these pieces, one read each."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces, self.read = pieces, 0

    async def __aiter__(self):
        for piece in self.pieces:
            self.read += 1
            yield piece


async def batches(pieces: list[bytes]) -> list[list[dict]]:
    response = httpx.Response(200, stream=Reads(pieces))
    return [batch async for batch in event_batches(response.aiter_raw())]


async def test_events_waiting_together_are_one_batch_and_a_cut_line_waits_for_its_end():
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}\n\n'
    stream = chat_event("The") + chat_event(" answer") + chat_event(" is", "length") + usage + b"data: [DONE]\n\n"
    cut = stream.index(b"answer") + 3  # the network splits the second event's JSON
    found = await batches([stream[:cut], stream[cut:]])
    assert [len(batch) for batch in found] == [1, 3]  # the first read holds one whole event; the rest the others
    result = Completion()
    texts = ["".join(t for event in batch for t in read_event(event, result, completion=False)) for batch in found]
    assert texts == ["The", " answer is"] and result.text == "The answer is"
    assert (result.finish_reason, result.prompt_tokens, result.completion_tokens) == ("length", 9, 3)


async def test_nothing_after_done_is_parsed_but_the_body_is_read_to_its_end_and_comments_are_skipped():
    reads = Reads([b": keep-alive\n\n" + chat_event("a"), b"data: [DONE]\n\n" + chat_event("never"), b"\n"])
    found = [batch async for batch in event_batches(httpx.Response(200, stream=reads).aiter_raw())]
    assert found == [[{"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}]]
    assert reads.read == 3, "read to the end: a response closed early takes its connection with it"
