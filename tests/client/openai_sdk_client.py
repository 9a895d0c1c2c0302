#!/usr/bin/env python3
"""The official `openai` Python SDK's realtime client (GA, `client.realtime.connect`) against
antiphon's OpenAI Realtime dialect, configured only by its base URL. It checks:

1. the session: session.created, then session.update (instructions, turn detection off) answered
   by session.updated echoing what was set;
2. a text turn: conversation.item.create (the item id echoed), response.create with metadata
   (echoed), audio deltas that decode to PCM16, transcript deltas that add up to the transcript,
   response.done completed with usage;
3. an audio turn: input_audio_buffer.append + commit (committed, the user item), response.create,
   with input transcription on: the item's transcript (the Thinker's own) as
   conversation.item.input_audio_transcription.delta / .completed;
4. cancelling: response.cancel on the first audio delta ends the response cancelled
   (client_cancelled); a second cancel is the benign error `response_cancel_not_active`, after
   which the session still answers;
5. a tool loop: a function declared in session.update; a reply the client began (an assistant
   message created `incomplete`, antiphon's extension, since synthetic weights never call by
   themselves) calls it: a function_call item with its argument events, response.done listing
   it; the function_call_output answered by a spoken response; then the tools are taken away;
6. server VAD: speech, silence, speech (espeak-ng phrases from assets/vad/) streamed at once:
   speech_started / speech_stopped at the true edges (within 100 ms), a response created by the
   server after each turn, the first cut short by the second turn (barge-in: cancelled,
   turn_detected), conversation.item.truncate answered by conversation.item.truncated;
7. every event the server sent validates as the SDK's own typed `RealtimeServerEvent` (pydantic,
   so a missing field, a wrong literal or an unknown type fails), and every event has an event_id.

    python3 tests/client/openai_sdk_client.py http://127.0.0.1:8080/openai/v1

Needs the `openai` package (and `websockets`, which it uses). Exits non-zero on a failed check.
"""
import argparse
import asyncio
import base64
import json
import os
import struct
import sys
import wave

import pydantic
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent

ADAPTER = pydantic.TypeAdapter(RealtimeServerEvent)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SEEN_TYPES = set()


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


class Conn:
    """The SDK's connection, every raw event validated against the SDK's types first."""

    def __init__(self, conn):
        self.c = conn

    async def next(self, timeout=120):
        raw = await asyncio.wait_for(self.c.recv_bytes(), timeout)
        data = json.loads(raw)
        check(isinstance(data.get("event_id"), str) and data["event_id"], f"an event without event_id: {data}")
        try:
            ADAPTER.validate_python(data)
        except pydantic.ValidationError as e:
            fail(f"the SDK's types refuse {data.get('type')}: {e}\n{json.dumps(data)[:800]}")
        SEEN_TYPES.add(data["type"])
        # and the SDK's own parser gives the typed event
        ev = self.c.parse_event(raw)
        check(ev.type == data["type"], f"parse_event gave {ev.type} for {data['type']}")
        return ev

    async def until(self, ty, timeout=120, collect=None):
        while True:
            ev = await self.next(timeout)
            if collect is not None:
                collect.append(ev)
            if ev.type == "error" and ty != "error":
                fail(f"unexpected error while waiting for {ty}: {ev.error}")
            if ev.type == ty:
                return ev


def pcm16_b64(samples):
    return base64.b64encode(struct.pack(f"<{len(samples)}h", *samples)).decode()


def phrase(name):
    """An espeak-ng phrase at 24 kHz (linear interpolation from 22.05 kHz), cut to its extent."""
    w = wave.open(os.path.join(ROOT, "assets", "vad", name))
    rate, n = w.getframerate(), w.getnframes()
    x = struct.unpack(f"<{n}h", w.readframes(n))
    out = []
    m = n * 24000 // rate
    for i in range(m):
        t = i * rate / 24000
        j = int(t)
        a, b = x[min(j, n - 1)], x[min(j + 1, n - 1)]
        out.append(int(a + (b - a) * (t - j)))
    first = next(i for i, v in enumerate(out) if abs(v) > 327)
    last = max(i for i, v in enumerate(out) if abs(v) > 327)
    return out[first:last + 1]


def speech_silence_speech():
    a, b = phrase("phrase1.wav"), phrase("phrase2.wav")
    x = [0] * int(0.8 * 24000)
    s1 = len(x) // 24
    x += a
    e1 = len(x) // 24
    x += [0] * int(1.2 * 24000)
    s2 = len(x) // 24
    x += b
    e2 = len(x) // 24
    x += [0] * int(1.0 * 24000)
    seed = 0x2545F491
    for i in range(len(x)):
        seed = (seed * 1664525 + 1013904223) & 0xFFFFFFFF
        x[i] = max(-32768, min(32767, x[i] + int(((seed >> 8) / (1 << 24) - 0.5) * 20)))
    return x, [s1, e1, s2, e2]


async def response_events(c, collect):
    done = await c.until("response.done", collect=collect)
    return done.response


def audio_bytes(events):
    n = 0
    for e in events:
        if e.type == "response.output_audio.delta":
            b = base64.b64decode(e.delta)
            check(len(b) % 2 == 0, "an audio delta of odd length (not PCM16)")
            n += len(b)
    return n


async def main(base):
    client = AsyncOpenAI(api_key=os.environ.get("ANTIPHON_KEY", "sk-antiphon-test"), websocket_base_url=base.replace("http", "ws", 1))
    async with client.realtime.connect(model="gpt-realtime") as raw:
        c = Conn(raw)
        created = await c.until("session.created")
        check(created.session.type == "realtime", f"session.created: {created.session}")
        check(created.session.audio.output.format.type == "audio/pcm", "default output is audio/pcm")
        print("session.created:", created.session.id)

        # 1. session.update
        await raw.session.update(session={"type": "realtime", "instructions": "Answer briefly.", "audio": {"input": {"turn_detection": None}}})
        upd = await c.until("session.updated")
        check(upd.session.instructions == "Answer briefly.", f"instructions not echoed: {upd.session.instructions}")
        check(upd.session.audio.input.turn_detection is None, "turn detection not turned off")
        print("session.update: ok")

        # 2. a text turn
        await raw.conversation.item.create(item={"id": "item_user_text_1", "type": "message", "role": "user",
                                                 "content": [{"type": "input_text", "text": "Hello there"}]})
        added = await c.until("conversation.item.added")
        check(added.item.id == "item_user_text_1", f"item id not echoed: {added.item.id}")
        await c.until("conversation.item.done")
        await raw.response.create(response={"metadata": {"client_event_id": "turn-1"}})
        evs = []
        created_r = await c.until("response.created", collect=evs)
        check(created_r.response.metadata == {"client_event_id": "turn-1"}, f"metadata not echoed: {created_r.response.metadata}")
        resp = await response_events(c, evs)
        check(resp.status == "completed", f"text turn ended {resp.status}: {resp.status_details}")
        n = audio_bytes(evs)
        check(n > 0, "no audio in the text turn")
        deltas = "".join(e.delta for e in evs if e.type == "response.output_audio_transcript.delta")
        tdone = [e for e in evs if e.type == "response.output_audio_transcript.done"]
        check(len(tdone) == 1 and tdone[0].transcript == deltas and deltas, f"transcript {deltas!r} vs {tdone}")
        check(resp.usage is not None and resp.usage.output_tokens > 0, f"usage: {resp.usage}")
        order = [e.type for e in evs if not e.type.endswith(".delta")]
        want = ["response.created", "response.output_item.added", "conversation.item.added", "response.content_part.added",
                "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
                "conversation.item.done", "response.output_item.done", "response.done"]
        check(order == want, f"the response's events: {order}")
        print(f"text turn: {n // 48} ms of audio, transcript {deltas[:40]!r}")

        # 3. an audio turn, transcribed
        await raw.session.update(session={"type": "realtime", "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}})
        upd = await c.until("session.updated")
        check(upd.session.audio.input.transcription is not None and upd.session.audio.input.transcription.model == "gpt-4o-transcribe",
              f"transcription not echoed: {upd.session.audio.input.transcription}")
        tone = [int(8000 * ((i // 60) % 2 * 2 - 1)) for i in range(24000)]
        for i in range(0, len(tone), 4800):
            await raw.input_audio_buffer.append(audio=pcm16_b64(tone[i:i + 4800]))
        await raw.input_audio_buffer.commit()
        committed = await c.until("input_audio_buffer.committed")
        item = await c.until("conversation.item.added")
        check(item.item.id == committed.item_id and item.item.role == "user", f"committed {committed.item_id}, item {item.item}")
        await raw.response.create()
        evs, resp, heard = [], None, None
        while resp is None or heard is None:
            ev = await c.next()
            evs.append(ev)
            if ev.type == "error":
                fail(f"error in the audio turn: {ev.error}")
            elif ev.type == "response.done":
                resp = ev.response
            elif ev.type == "conversation.item.input_audio_transcription.completed":
                check(ev.item_id == committed.item_id, f"a transcript for {ev.item_id}, not the committed {committed.item_id}")
                heard = ev.transcript
        check(resp.status == "completed" and audio_bytes(evs) > 0, f"audio turn: {resp.status}")
        deltas = "".join(e.delta or "" for e in evs if e.type == "conversation.item.input_audio_transcription.delta")
        check(heard and deltas == heard, f"transcript {heard!r} vs its deltas {deltas!r}")
        await raw.session.update(session={"type": "realtime", "audio": {"input": {"transcription": None}}})
        await c.until("session.updated")
        print(f"audio turn: {audio_bytes(evs) // 48} ms of audio, transcribed as {heard[:30]!r}")

        # 4. cancel
        await raw.conversation.item.create(item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story"}]})
        await raw.response.create()
        evs = []
        await c.until("response.output_audio.delta", collect=evs)
        await raw.response.cancel()
        resp = await response_events(c, evs)
        check(resp.status == "cancelled" and resp.status_details.reason == "client_cancelled", f"cancel: {resp.status} {resp.status_details}")
        await raw.response.cancel(event_id="cancel-again")
        err = await c.until("error")
        check(err.error.code == "response_cancel_not_active" and err.error.event_id == "cancel-again", f"second cancel: {err.error}")
        await raw.conversation.item.create(item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Still there?"}]})
        await raw.response.create()
        resp = await response_events(c, [])
        check(resp.status == "completed", "the session no longer answers after a benign error")
        print("cancel: ok")

        # 5. a tool loop
        weather = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
        await raw.session.update(session={"type": "realtime", "tools": [weather], "tool_choice": "auto"})
        upd = await c.until("session.updated")
        check([t.name for t in upd.session.tools] == ["get_weather"] and upd.session.tool_choice == "auto", f"tools not echoed: {upd.session}")
        await raw.conversation.item.create(item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]})
        await c.until("conversation.item.done")
        call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        await raw.conversation.item.create(item={"type": "message", "role": "assistant", "status": "incomplete",
                                                 "content": [{"type": "output_text", "text": call_text}]})
        await c.until("conversation.item.done")
        await raw.response.create(response={"max_output_tokens": 200})
        evs = []
        resp = await response_events(c, evs)
        check(resp.status == "completed", f"the calling response ended {resp.status}: {resp.status_details}")
        check([o.type for o in resp.output] == ["function_call"], f"the calling response's output: {resp.output}")
        call = resp.output[0]
        check(call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id, f"the call: {call}")
        done_args = [e for e in evs if e.type == "response.function_call_arguments.done"]
        check(len(done_args) == 1 and done_args[0].call_id == call.call_id and done_args[0].arguments == call.arguments, f"arguments.done: {done_args}")
        check(audio_bytes(evs) == 0, "a response that only calls has no audio")
        await raw.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature_c": 18})})
        await c.until("conversation.item.done")
        await raw.response.create()
        evs = []
        resp = await response_events(c, evs)
        check(resp.status == "completed" and audio_bytes(evs) > 0 and resp.output[0].type == "message", f"the answer: {resp.status} {resp.output}")
        await raw.session.update(session={"type": "realtime", "tools": [], "tool_choice": "auto"})
        await c.until("session.updated")
        print(f"tool loop: get_weather called ({call.call_id}), its output answered with {audio_bytes(evs) // 48} ms of audio")

        # 6. server VAD, barge-in and truncation
        await raw.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
            "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}}}})
        await c.until("session.updated")
        x, truth = speech_silence_speech()
        # audio_start_ms / audio_end_ms count all audio the session was sent: the audio turn's second first
        truth = [t + len(tone) // 24 for t in truth]
        for i in range(0, len(x), 2400):
            await raw.input_audio_buffer.append(audio=pcm16_b64(x[i:i + 2400]))
        edges, dones, assistant_items = [], [], []
        while len(dones) < 2:
            ev = await c.next()
            if ev.type == "error":
                fail(f"error during the VAD turns: {ev.error}")
            if ev.type == "input_audio_buffer.speech_started":
                edges.append(ev.audio_start_ms + 300)
            elif ev.type == "input_audio_buffer.speech_stopped":
                edges.append(ev.audio_end_ms)
            elif ev.type == "response.output_item.added":
                assistant_items.append(ev.item.id)
            elif ev.type == "response.done":
                dones.append(ev.response)
        check(len(edges) == 4, f"edges {edges}")
        for got, want in zip(edges, truth):
            check(abs(got - want) <= 100, f"VAD edges {edges} vs the truth {truth}")
        first, second = dones
        check(first.status == "cancelled" and first.status_details.reason == "turn_detected",
              f"the first VAD turn's response: {first.status} {first.status_details} (the second turn should cut it short)")
        check(second.status == "completed", f"the second VAD turn's response: {second.status}")
        await raw.conversation.item.truncate(item_id=assistant_items[0], content_index=0, audio_end_ms=0)
        tr = await c.until("conversation.item.truncated")
        check(tr.item_id == assistant_items[0], f"truncated {tr.item_id}")
        print(f"server VAD: edges {edges} vs truth {truth}; barge-in cancelled the first response; truncate ok")

    print("event types seen, all valid as the SDK's types:", " ".join(sorted(SEEN_TYPES)))
    print("openai SDK client: all checks passed")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("base", help="the dialect's base URL, e.g. http://127.0.0.1:8080/openai/v1")
    asyncio.run(main(p.parse_args().base))
