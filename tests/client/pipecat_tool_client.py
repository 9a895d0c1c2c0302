#!/usr/bin/env python3
"""pipecat's OpenAI Realtime service (`OpenAIRealtimeLLMService`, pipecat-ai from PyPI) running a
function call against antiphon's OpenAI Realtime dialect, configured only by its URL. A pipeline
of the user context aggregator, the service, a frame collector and the assistant aggregator
(pipecat's own tool loop: the assistant aggregator asks for the response that answers a result):

- the tool: `get_weather(city)` in the LLMContext's ToolsSchema (pipecat sends it in session.update),
  its handler registered with `register_function`, returning {"temperature_c": 18};
- the context holds one user message; LLMRunFrame starts the response;
- synthetic weights never call by themselves, so the one hook, `send_client_event` overridden,
  puts antiphon's extension just before the first response.create: an assistant message with
  status "incomplete" holding the call, which the response continues (tool_call_checks.py);
- the response calls get_weather({"city": "Paris"}); pipecat runs the handler once, sends the
  function_call_output and a response.create, and that answer comes with 24 kHz audio.

Run twice, on two sockets: the call alone (a response with no audio), then with words before the
call ("Let me check." spoken, then the call). Every server event is also checked raw
(tool_call_checks.py: order, ids, arguments); no error (pipecat's on_error, which is where its
ErrorFrames start: they travel upstream) may appear.

    python3 tests/client/pipecat_tool_client.py ws://127.0.0.1:8080/openai/v1/realtime
"""
import argparse
import asyncio
import json
import os
import sys

import pipecat.services.openai.realtime.events as rt_events
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (
    ErrorFrame,
    FunctionCallInProgressFrame,
    FunctionCallResultFrame,
    LLMFullResponseEndFrame,
    LLMRunFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

import tool_call_checks as tc

ARGS = {"city": "Paris"}
RESULT = {"temperature_c": 18}


def fail(msg):
    print("FAIL:", msg, flush=True)
    os._exit(1)  # at once: a pipeline or session still running must not hold the exit


class Watch:
    """Everything the run saw, and a bounded wait on it (no sleeps)."""

    def __init__(self):
        self.server = []      # raw server events, as sent
        self.client = []      # client events, as sent
        self.frames = []      # (response number, frame kind)
        self.audio = {}       # response number -> PCM bytes
        self.calls = []       # what the handler was called with
        self.problems = []
        self.changed = asyncio.Event()

    def note(self):
        self.changed.set()

    def responses_done(self):
        return sum(1 for e in self.server if e.get("type") == "response.done")

    async def until(self, cond, what, timeout=180):
        if not await tc.wait_until(cond, self.changed, lambda: bool(self.problems), timeout):
            fail(f"no {what} within {timeout} s; server events {[e.get('type') for e in self.server]}")
        if self.problems:
            fail(self.problems[0])


WATCH = None
_parse = rt_events.parse_server_event


def recording_parse(message):
    """pipecat parses every server event through this module function; it is wrapped to keep the
    raw event (and a parse failure, which would otherwise only end pipecat's receive task)."""
    try:
        WATCH.server.append(json.loads(message))
        return _parse(message)
    except Exception as e:
        WATCH.problems.append(f"pipecat could not parse a server event: {e}")
        raise
    finally:
        WATCH.note()


rt_events.parse_server_event = recording_parse


class ToolService(OpenAIRealtimeLLMService):
    """The stock service with one hook: `prefill`, when set, goes out as antiphon's incomplete
    assistant item right before the next response.create, so that it is the last item created."""

    def __init__(self, *, prefill, **kwargs):
        super().__init__(**kwargs)
        self.prefill = prefill

    async def send_client_event(self, event):
        if isinstance(event, rt_events.ResponseCreateEvent) and self.prefill is not None:
            item = rt_events.ConversationItem(**tc.prefill_item(self.prefill))
            self.prefill = None
            # as pipecat does for the items it creates itself: its echo is not a response starting
            self._messages_added_manually[item.id] = True
            await self._send(rt_events.ConversationItemCreateEvent(item=item))
        await self._send(event)

    async def _send(self, event):
        WATCH.client.append(event.model_dump(exclude_none=True))
        await super().send_client_event(event)


class Collector(FrameProcessor):
    def __init__(self, watch):
        super().__init__()
        self.w = watch
        self.n = 1  # the response the frames belong to

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, ErrorFrame):
            self.w.problems.append(f"pipecat reported an error: {frame.error}")
        kind = type(frame).__name__
        if isinstance(frame, (TTSStartedFrame, TTSStoppedFrame, FunctionCallInProgressFrame, FunctionCallResultFrame)):
            self.w.frames.append((self.n, kind))
        if isinstance(frame, TTSAudioRawFrame):
            if self.w.frames[-1:] != [(self.n, kind)]:
                self.w.frames.append((self.n, kind))
            if frame.sample_rate != 24000:
                self.w.problems.append(f"audio at {frame.sample_rate} Hz")
            self.w.audio[self.n] = self.w.audio.get(self.n, 0) + len(frame.audio)
        if isinstance(frame, LLMFullResponseEndFrame):
            self.w.frames.append((self.n, kind))
            self.n += 1
        self.w.note()
        await self.push_frame(frame, direction)


async def scenario(url, preamble):
    global WATCH
    w = WATCH = Watch()
    spoken = bool(preamble)
    # (a call's text counts in the reply's tokens: the embedded default's 64 would cut the one
    # after "Let me check.", so the session allows 200)
    settings = OpenAIRealtimeLLMService.Settings(session_properties=rt_events.SessionProperties(max_output_tokens=200))
    llm = ToolService(api_key=os.environ.get("ANTIPHON_KEY", "sk-antiphon-test"), base_url=url, settings=settings,
                      prefill=tc.prefill_text("get_weather", ARGS, preamble))

    @llm.event_handler("on_error")
    async def on_error(processor, error):
        w.problems.append(f"pipecat reported an error: {error.error}")
        w.note()

    async def get_weather(params):
        w.calls.append((params.function_name, params.tool_call_id, dict(params.arguments)))
        w.note()
        await params.result_callback(RESULT)

    llm.register_function("get_weather", get_weather)
    weather = FunctionSchema(name="get_weather", description="Get the current weather in a city.",
                             properties={"city": {"type": "string", "description": "The city name."}}, required=["city"])
    context = LLMContext(messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                         tools=ToolsSchema(standard_tools=[weather]))
    pair = LLMContextAggregatorPair(context)
    collector = Collector(w)
    worker = PipelineWorker(Pipeline([pair.user(), llm, collector, pair.assistant()]), idle_timeout_secs=None, enable_rtvi=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())

    await worker.queue_frame(LLMRunFrame())
    await w.until(lambda: w.responses_done() >= 2 and collector.n > 2 and w.calls, "two responses (the call, the answer)")
    label = "with words before it" if spoken else "alone"

    # what went out: the tool in session.update before any response; the extension last before the first response.create
    creates = [i for i, e in enumerate(w.client) if e["type"] == "response.create"]
    updates = [e for e in w.client[:creates[0]] if e["type"] == "session.update"]
    tools = [t for e in updates for t in (e["session"].get("tools") or [])]
    if not any(t.get("type") == "function" and t.get("name") == "get_weather"
               and "city" in (t.get("parameters") or {}).get("properties", {}) for t in tools):
        fail(f"no session.update with the get_weather tool before the first response.create: {tools}")
    before = w.client[creates[0] - 1]
    if before["type"] != "conversation.item.create" or before["item"].get("status") != "incomplete":
        fail(f"the event before the first response.create is {before}, not the incomplete assistant item")
    echoed = [e for e in w.server if e["type"] == "session.updated"]
    if not echoed or not any(t.get("name") == "get_weather" for t in echoed[-1]["session"].get("tools") or []):
        fail("session.updated does not echo the get_weather tool")

    # the server's events, raw
    rids = tc.response_ids(w.server)
    try:
        call = tc.check_call_response(tc.response_events(w.server, rids[0]), "get_weather", ARGS, spoken=spoken)
        tc.check_answered(w.client, call["call_id"], json.dumps(RESULT))
        pcm, text = tc.check_answer_response(tc.response_events(w.server, rids[1]))
    except tc.CheckError as e:
        fail(f"call {label}: {e}")
    if len(rids) != 2 or len(creates) != 2:
        fail(f"{len(rids)} responses for {len(creates)} response.create, expected 2 and 2")

    # what pipecat made of them
    if w.calls != [("get_weather", call["call_id"], ARGS)]:
        fail(f"the handler ran as {w.calls}, expected once with {call['call_id']} {ARGS}")
    first = [k for n, k in w.frames if n == 1 and not k.startswith("FunctionCall")]
    second = [k for n, k in w.frames if n == 2 and not k.startswith("FunctionCall")]
    fn = [k for n, k in w.frames if k.startswith("FunctionCall")]
    want = (["TTSStartedFrame", "TTSAudioRawFrame", "TTSStoppedFrame"] if spoken else []) + ["LLMFullResponseEndFrame"]
    if first != want:
        fail(f"call {label}: response 1 frames {first}, expected {want}")
    if fn != ["FunctionCallInProgressFrame", "FunctionCallResultFrame"]:
        fail(f"call {label}: function call frames {fn}, expected one in progress, then its result")
    # pipecat starts TTS once per bot turn (until BotStoppedSpeakingFrame, which needs a transport)
    if "TTSAudioRawFrame" not in second or second[-2:] != ["TTSStoppedFrame", "LLMFullResponseEndFrame"]:
        fail(f"call {label}: the answer's frames {second}")
    if w.audio.get(1, 0) != call["audio_bytes"] or w.audio.get(2, 0) != len(pcm):
        fail(f"call {label}: pipecat got {w.audio} bytes of audio by response; the server sent {call['audio_bytes']} and {len(pcm)}")
    print(f"PASS call {label}: get_weather({call['arguments']}) call_id {call['call_id']}, handler ran once, "
          f"answer {len(pcm) // 48} ms of audio ({text[:40]!r}); pipecat frames {first} then {second}")

    await worker.cancel()
    await run
    if w.problems:
        fail(w.problems[0])


async def main(url):
    await scenario(url, "")
    await scenario(url, "Let me check.\n")
    print("pipecat tool client: all checks passed")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url", help="the dialect's WebSocket URL, e.g. ws://127.0.0.1:8080/openai/v1/realtime")
    asyncio.run(main(p.parse_args().url))
    sys.exit(0)
