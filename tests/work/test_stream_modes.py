"""/generate streams as SGLang sends them: totals by default, deltas with --incremental-streaming-output.

The mode comes from /server_info and is checked on the chunks themselves; against the simulator over
HTTP in both modes the streamed output_ids equal a non-streaming call's, and a server whose mode
changes mid-run gives correct answers (or a clear error), never truncated or doubled ones."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from regen_service.work.client.http import StreamModeError
from regen_service.work.client.pool import EndpointPool
from regen_service.work.client.streams import GenerateStream
from tests.procs import sim_server
from tests.work.test_client_faults import FAST, MODEL, fast_config

END = {"finish_reason": {"type": "stop", "matched": 7}, "prompt_tokens": 3, "completion_tokens": 4}
TOTALS = [([1], "a"), ([1, 2], "ab"), ([1, 2, 3], "abc"), ([1, 2, 3, 7], "abcd")]
DELTAS = [([1], "a"), ([2], "b"), ([3], "c"), ([7], "d")]


def fold(mode: str, chunks) -> GenerateStream:
    acc = GenerateStream("e", mode)
    for k, (ids, text) in enumerate(chunks):
        last = k == len(chunks) - 1
        acc.feed(
            {
                "text": text,
                "output_ids": ids,
                "meta_info": END if last else {"completion_tokens": len(TOTALS[k][0])},
            }
        )
    return acc


@pytest.mark.parametrize("chunks", [TOTALS, DELTAS], ids=["cumulative", "incremental"])
def test_auto_detects_the_mode_from_the_chunks(chunks):
    c = fold("auto", chunks).result()
    assert (c.output_ids, c.text) == ([1, 2, 3, 7], "abcd")


def test_repeated_tokens_as_deltas_are_told_apart_by_the_count():
    # deltas [5], [5]: as totals that would be "one token"; the server counted two
    acc = GenerateStream("e", "auto")
    acc.feed({"text": "x", "output_ids": [5], "meta_info": {"completion_tokens": 1}})
    acc.feed({"text": "x", "output_ids": [5], "meta_info": END | {"completion_tokens": 2}})
    assert acc.result().output_ids == [5, 5]


def test_a_stream_that_contradicts_the_announced_mode_is_an_error():
    with pytest.raises(StreamModeError, match="does not extend"):
        fold("cumulative", DELTAS)
    with pytest.raises(StreamModeError, match="holds 3 output ids but the server counted 2"):
        fold("incremental", TOTALS)
    acc = GenerateStream("e", "auto")  # neither fold gives the server's count
    with pytest.raises(StreamModeError, match="counted 9"):
        acc.feed({"text": "a", "output_ids": [1], "meta_info": END | {"completion_tokens": 9}})


def test_without_counts_growing_totals_settle_and_text_only_streams_fold_by_text():
    acc = GenerateStream("e", "auto")
    for ids, text in TOTALS:
        acc.feed({"text": text, "output_ids": ids, "meta_info": {}})
    acc.feed({"text": "abcd", "output_ids": [1, 2, 3, 7], "meta_info": {"finish_reason": {"type": "stop"}}})
    assert acc.mode == "cumulative" and acc.result().output_ids == [1, 2, 3, 7]
    acc = GenerateStream("e", "auto")  # no output_ids at all: the text, and no ids to store
    for text in ("a", "ab"):
        acc.feed({"text": text, "meta_info": {"completion_tokens": len(text)}})
    acc.feed({"text": "abc", "meta_info": END | {"completion_tokens": 3}})
    c = acc.result()
    assert (c.text, c.output_ids) == ("abc", None)


async def _answers(url: str, prompts: list[list[int]], **cfg) -> tuple[list, list, str]:
    out = {}
    for stream in (True, False):
        async with EndpointPool(fast_config([url], stream=stream, **cfg), MODEL) as pool:
            mode = pool.endpoints[0].stream_mode
            done = []
            for ids in prompts:
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 48, "temperature": 0}}
                c = await pool.complete("generate", body, prompt_len=len(ids))
                done.append((c.output_ids, c.text))
            out[stream] = (done, mode)
    return out[True][0], out[False][0], out[True][1]


PROMPTS = [[1000 + i, 1001 + i, 1002 + i, 5 + i] for i in range(6)]


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_streamed_output_ids_match_a_non_streaming_call(incremental):
    flags = ("--incremental-streaming-output",) if incremental else ()
    with sim_server(*FAST, *flags) as url:
        streamed, whole, mode = asyncio.run(_answers(url, PROMPTS))
    assert mode == ("incremental" if incremental else "cumulative")  # read from /server_info
    assert streamed == whole and all(len(ids) > 3 for ids, _ in streamed)


def test_server_that_switches_mode_mid_run_still_gives_exact_answers():
    async def go(url: str) -> tuple[list, list, list]:
        async with EndpointPool(fast_config([url]), MODEL) as pool:
            ep = pool.endpoints[0]
            modes = [ep.stream_mode]
            got = []
            for k, ids in enumerate(PROMPTS):
                if k == 3:  # the server "restarts" with --incremental-streaming-output
                    httpx.post(
                        f"{url}/sim/config", json={"incremental_streaming_output": True}
                    ).raise_for_status()
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 48, "temperature": 0}}
                got.append((await pool.complete("generate", body, prompt_len=len(ids))).output_ids)
                modes.append(ep.stream_mode)
        async with EndpointPool(fast_config([url], stream=False), MODEL) as pool:
            want = []
            for ids in PROMPTS:
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 48, "temperature": 0}}
                want.append((await pool.complete("generate", body, prompt_len=len(ids))).output_ids)
        return got, want, modes

    with sim_server(*FAST) as url:
        got, want, modes = asyncio.run(go(url))
    assert got == want
    assert modes[0] == "cumulative" and modes[-1] in ("auto", "incremental")
