#!/usr/bin/env python3
"""LiveKit Agents' OpenAI Realtime plugin (livekit-plugins-openai: `RealtimeModel(base_url=...)`
and its `RealtimeSession`, driven directly, with no LiveKit server or room) against antiphon's
OpenAI Realtime dialect, configured only by its base URL. Driven the way LiveKit's AgentActivity
drives it (agents/voice/agent_activity.py): `update_chat_ctx` for user items and tool results,
`generate_reply` for responses, the generation's message and function streams for the output.

1. a text turn: a user message (update_chat_ctx, which waits for conversation.item.added), a reply
   with audio and its transcript;
2. a tool call: `get_weather` registered with `update_tools` (session.update with the tool);
   synthetic weights never call by themselves, so the one hook, the session's public
   `send_event`, sends antiphon's extension (an assistant item with status "incomplete" holding
   the call, tool_call_checks.py) right before `generate_reply`; the function stream yields
   get_weather({"city": "Paris"}); LiveKit's `execute_function_call` runs it; its output goes in
   with update_chat_ctx, and a second generate_reply answers with audio;
3. a chat-context replay on a fresh session: the first session's whole history (user and
   assistant messages, the function_call, its output) sent with update_chat_ctx; every item is
   added under its id, in order;
4. a delete: update_chat_ctx without the replayed answer sends conversation.item.delete, answered
   by conversation.item.deleted; a reply then answers from the function's output;
5. a reconnect: the socket dropped under the session; LiveKit dials again and replays the session,
   the tools and the history on the new socket (its own reconnect path); a reply follows.
6. a spoken turn with input transcription (`input_audio_transcription`): an espeak-ng phrase and a
   second of silence pushed as audio; the server's turn detection answers it, and the transcript
   (the Thinker's own) comes back as LiveKit's `input_audio_transcription_completed`: the deltas
   as they come, then the whole, for the item the server transcribed.

Every server event is checked raw too (tool_call_checks.py: the call's event order and ids, the
previous_item_id chain LiveKit's mirror of the conversation relies on); an `error` (event or
LiveKit's error emission) fails the run, but for the drop in 5.

    python3 tests/client/livekit_tool_client.py http://127.0.0.1:8080/openai/v1
"""
import argparse
import asyncio
import json
import os
import struct
import sys

import aiohttp
from livekit import rtc
from livekit.agents import llm
from livekit.plugins.openai.realtime import RealtimeModel
from openai.types.realtime import AudioTranscription

import tool_call_checks as tc

ARGS = {"city": "Paris"}


def fail(msg):
    print("FAIL:", msg, flush=True)
    os._exit(1)  # at once: a pipeline or session still running must not hold the exit


@llm.function_tool
async def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city name.
    """
    RAN.append(city)
    return json.dumps({"temperature_c": 18})


RAN = []


class Dialer:
    """The HTTP session LiveKit dials with (`http_session=`), keeping each socket so that step 5
    can drop one under the session."""

    def __init__(self):
        self.http = aiohttp.ClientSession()
        self.sockets = []

    async def ws_connect(self, *args, **kwargs):
        ws = await self.http.ws_connect(*args, **kwargs)
        self.sockets.append(ws)
        return ws


class Watch:
    """A session's raw server and client events (its public `openai_server_event_received` and
    `openai_client_event_queued` events) and its errors, with a bounded wait (no sleeps)."""

    def __init__(self, session):
        self.s = session
        self.server, self.client, self.errors = [], [], []
        self.allow_drop = False
        self.changed = asyncio.Event()
        session.on("openai_server_event_received", self._server)
        session.on("openai_client_event_queued", self._client)
        session.on("error", self._error)
        session.on("session_reconnected", lambda ev: self.changed.set())

    def _server(self, ev):
        self.server.append(ev)
        if ev.get("type") == "error":
            self.errors.append(f"error event: {ev.get('error')}")
        self.changed.set()

    def _client(self, ev):
        self.client.append(ev)
        self.changed.set()

    def _error(self, ev):
        drop = self.allow_drop and ev.recoverable and "closed unexpectedly" in str(ev.error)
        if not drop:
            self.errors.append(f"LiveKit reported an error: {ev.error} ({getattr(ev.error, 'body', None)})")
        self.changed.set()

    def check(self):
        if self.errors:
            fail(self.errors[0])

    async def until(self, cond, what, timeout=180):
        if not await tc.wait_until(cond, self.changed, lambda: bool(self.errors), timeout):
            fail(f"no {what} within {timeout} s; server events {[e.get('type') for e in self.server][-30:]}")
        self.check()

    def done(self, rid):
        return any(e.get("type") == "response.done" and e["response"].get("id") == rid for e in self.server)


async def bounded(aw, what, timeout=30):
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        fail(f"{what}: no result within {timeout} s")
    except llm.RealtimeError as e:
        fail(f"{what}: {e}")


async def reply(w, what, **kwargs):
    """generate_reply (its future is the response.created that echoes its metadata), then the
    whole response: returns (raw events, [(message id, PCM bytes, text)], [FunctionCall])."""
    gen = await bounded(w.s.generate_reply(**kwargs), f"{what}: generate_reply")
    rid = gen.response_id
    await w.until(lambda: w.done(rid), f"response.done of {what}")
    evs = tc.response_events(w.server, rid)
    msgs, calls = [], []

    async def drain():
        async for m in gen.message_stream:
            pcm, text = 0, ""
            async for f in m.audio_stream:
                pcm += f.samples_per_channel * 2
            async for t in m.text_stream:
                text += t
            msgs.append((m.message_id, pcm, text, await m.modalities))
        async for fc in gen.function_stream:
            calls.append(fc)

    await bounded(drain(), f"{what}: the generation's streams")
    return evs, msgs, calls


def check(step, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except tc.CheckError as e:
        fail(f"{step}: {e}")


def mirror_matches(w, step):
    ids = check(step, tc.check_item_chain, w.server)
    mine = [i.id for i in w.s.chat_ctx.items]
    if mine != ids:
        fail(f"{step}: LiveKit's mirror of the conversation {mine} differs from the server's {ids}")
    return ids


def check_answer(step, evs, msgs, calls):
    pcm, text = check(step, tc.check_answer_response, evs)
    if calls or len(msgs) != 1 or msgs[0][1] != len(pcm) or msgs[0][2] != text or "audio" not in msgs[0][3]:
        fail(f"{step}: LiveKit saw messages {[(m[0], m[1], m[2][:30], m[3]) for m in msgs]} and calls {calls}; "
             f"the server sent {len(pcm)} bytes, {text[:30]!r}")
    return pcm, text


async def add_items(w, step, *items):
    """update_chat_ctx with the mirror plus `items`, as AgentActivity does; each must be added."""
    ctx = w.s.chat_ctx.copy()
    ctx.items.extend(items)
    await bounded(w.s.update_chat_ctx(ctx), f"{step}: update_chat_ctx")
    w.check()
    have = {i.id for i in w.s.chat_ctx.items}
    missing = [i.id for i in items if i.id not in have]
    if missing:
        fail(f"{step}: items {missing} were not added (update_chat_ctx only logs a refusal)")


async def main(url):
    key = os.environ.get("ANTIPHON_KEY", "sk-antiphon-test")
    dialer = Dialer()
    model = RealtimeModel(api_key=key, base_url=url, http_session=dialer)
    s1 = model.session()
    w1 = Watch(s1)
    await s1.update_tools([get_weather])
    await w1.until(lambda: any(t.get("name") == "get_weather" for e in w1.server if e.get("type") == "session.updated"
                               for t in e["session"].get("tools") or []), "session.updated echoing the tool")

    # 1. a text turn
    await add_items(w1, "text turn", llm.ChatMessage(role="user", content=["Hello, how are you?"]))
    evs, msgs, calls = await reply(w1, "the text turn")
    pcm, text = check_answer("text turn", evs, msgs, calls)
    mirror_matches(w1, "text turn")
    print(f"PASS text turn: {len(pcm) // 48} ms of audio, transcript {text[:40]!r}")

    # 2. a tool call, run by the client and answered
    await add_items(w1, "tool call", llm.ChatMessage(role="user", content=["What is the weather in Paris?"]))
    s1.send_event({"type": "conversation.item.create", "item": tc.prefill_item(tc.prefill_text("get_weather", ARGS))})
    evs, msgs, calls = await reply(w1, "the calling response", tool_choice="auto")
    call = check("tool call", tc.check_call_response, evs, "get_weather", ARGS)
    if msgs or len(calls) != 1 or (calls[0].name, calls[0].call_id, calls[0].arguments, calls[0].id) != \
            ("get_weather", call["call_id"], call["arguments"], call["item_id"]):
        fail(f"tool call: LiveKit's function stream {calls} (and messages {msgs}), expected the one call {call}")
    result = await llm.execute_function_call(
        llm.FunctionToolCall(name=calls[0].name, arguments=calls[0].arguments, call_id=calls[0].call_id),
        llm.ToolContext([get_weather]))
    if RAN != ["Paris"] or result.fnc_call_out is None or result.fnc_call_out.is_error:
        fail(f"tool call: the tool ran as {RAN}, output {result.fnc_call_out}")
    sent = len(w1.client)
    await add_items(w1, "tool call", result.fnc_call_out)
    evs, msgs, calls = await reply(w1, "the answer to the output", tool_choice="auto")
    check("tool call", tc.check_answered, w1.client[sent:], call["call_id"], result.fnc_call_out.output)
    pcm, text = check_answer("tool call", evs, msgs, calls)
    ids = mirror_matches(w1, "tool call")
    items = w1.s.chat_ctx.items
    fc = next((i for i in items if i.type == "function_call"), None)
    if fc is None or fc.arguments != call["arguments"] or ids.index(fc.id) + 1 >= len(ids) \
            or items[ids.index(fc.id) + 1].type != "function_call_output":
        fail(f"tool call: the mirror's function_call {fc} (its arguments come from output_item.done), and its output after it")
    print(f"PASS tool call: get_weather({call['arguments']}) call_id {call['call_id']} run by LiveKit, "
          f"output {result.fnc_call_out.output}, answer {len(pcm) // 48} ms of audio")

    # 3. the history replayed on a fresh session
    history = s1.chat_ctx.copy()
    s2 = model.session()
    w2 = Watch(s2)
    await s2.update_tools([get_weather])
    await bounded(s2.update_chat_ctx(history), "replay: update_chat_ctx")
    w2.check()
    replayed = [i.id for i in history.items if i.type != "message" or i.content]
    ids = mirror_matches(w2, "replay")
    if ids != replayed:
        fail(f"replay: the new session holds {ids}, expected {replayed}")
    created = [e for e in w2.client if e.get("type") == "conversation.item.create"]
    if [e["item"]["id"] for e in created] != replayed or created[0].get("previous_item_id") != "root":
        fail(f"replay: LiveKit sent {[(e['item']['id'], e.get('previous_item_id')) for e in created]}")
    kinds = [e["item"]["type"] for e in created]
    print(f"PASS replay on a fresh session: {len(ids)} items added in order ({', '.join(kinds)})")

    # 4. a delete: the replayed answer, as LiveKit drops an unheard reply; then a reply from the output
    answer = history.items[-1]
    if answer.type != "message" or answer.role != "assistant":
        fail(f"delete: the history ends with {answer}, not the answer")
    ctx = s2.chat_ctx.copy()
    ctx.items = [i for i in ctx.items if i.id != answer.id]
    await bounded(s2.update_chat_ctx(ctx), "delete: update_chat_ctx")
    w2.check()
    if not any(e.get("type") == "conversation.item.delete" and e.get("item_id") == answer.id for e in w2.client):
        fail("delete: LiveKit sent no conversation.item.delete")
    if not any(e.get("type") == "conversation.item.deleted" and e.get("item_id") == answer.id for e in w2.server):
        fail("delete: no conversation.item.deleted")
    ids = mirror_matches(w2, "delete")
    if answer.id in ids:
        fail("delete: the item is still there")
    evs, msgs, calls = await reply(w2, "the reply after the delete")
    pcm, _ = check_answer("delete", evs, msgs, calls)
    mirror_matches(w2, "delete")
    print(f"PASS delete: conversation.item.deleted, then a reply from the function's output ({len(pcm) // 48} ms of audio)")

    # 5. a reconnect: the socket dropped under the session
    before = [i.id for i in s2.chat_ctx.items if i.type != "message" or i.content]
    mark, socks = len(w2.server), len(dialer.sockets)
    w2.allow_drop = True
    reconnected = asyncio.Event()
    s2.on("session_reconnected", lambda ev: reconnected.set())
    print("dropping the socket (LiveKit logs the drop as an error, then dials again)", flush=True)
    await dialer.sockets[-1].close()
    await w2.until(lambda: reconnected.is_set() and len(dialer.sockets) > socks
                   and sum(1 for e in w2.server[mark:] if e.get("type") == "conversation.item.added") >= len(before),
                   "the reconnected session's replay", timeout=60)
    w2.allow_drop = False
    fresh = w2.server[mark:]
    if not fresh or fresh[0].get("type") != "session.created":
        fail(f"reconnect: the new socket began with {fresh[:1]}")
    ids = mirror_matches(w2, "reconnect")
    if ids != before:
        fail(f"reconnect: the new socket holds {ids}, expected {before}")
    if not any(t.get("name") == "get_weather" for e in fresh if e.get("type") == "session.updated"
               for t in e["session"].get("tools") or []):
        fail("reconnect: no session.updated with the tool on the new socket")
    evs, msgs, calls = await reply(w2, "the reply after the reconnect")
    pcm, _ = check_answer("reconnect", evs, msgs, calls)
    print(f"PASS reconnect: the session, the tool and {len(ids)} items replayed on a new socket; "
          f"a reply with {len(pcm) // 48} ms of audio")

    for s, w in ((s1, w1), (s2, w2)):
        w.check()
        await bounded(s.aclose(), "aclose")
    await model.aclose()

    # 6. a spoken turn, with input transcription: the server's turn detection answers it, and the
    # caller's words come back as LiveKit's input_audio_transcription_completed (its user turn)
    heard_model = RealtimeModel(api_key=key, base_url=url, http_session=dialer,
                                input_audio_transcription=AudioTranscription(model="gpt-4o-transcribe"))
    s6 = heard_model.session()
    w6 = Watch(s6)
    heard = []

    def on_heard(ev):
        heard.append(ev)
        w6.changed.set()
    s6.on("input_audio_transcription_completed", on_heard)
    x = [0] * 12000 + tc.phrase_24k("phrase1.wav") + [0] * 24000
    for i in range(0, len(x), 480):
        piece = x[i:i + 480]
        s6.push_audio(rtc.AudioFrame(data=struct.pack(f"<{len(piece)}h", *piece), sample_rate=24000, num_channels=1,
                                     samples_per_channel=len(piece)))
    # (LiveKit reports the deltas as they come, is_final false, then the whole transcript)
    await w6.until(lambda: any(h.is_final for h in heard) and any(e.get("type") == "response.done" for e in w6.server),
                   "the spoken turn's transcript and its reply")
    item = next((e["item_id"] for e in w6.server if e.get("type") == "conversation.item.input_audio_transcription.completed"), None)
    final = [h for h in heard if h.is_final]
    partial = [h for h in heard if not h.is_final]
    if len(final) != 1 or not final[0].transcript or final[0].item_id != item or (partial and partial[-1].transcript != final[0].transcript):
        fail(f"spoken turn: transcripts {heard} (the server's was for {item})")
    done = next(e for e in w6.server if e.get("type") == "response.done")
    if done["response"]["status"] != "completed":
        fail(f"spoken turn: the reply ended {done['response']['status']}")
    print(f"PASS spoken turn: answered, and transcribed for item {item} ({len(final[0].transcript)} characters, {len(partial)} partial)")
    w6.check()
    await bounded(s6.aclose(), "aclose")
    await heard_model.aclose()
    await dialer.http.close()
    print("livekit tool client: all checks passed")



if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url", help="the dialect's base URL, e.g. http://127.0.0.1:8080/openai/v1")
    asyncio.run(main(p.parse_args().url))
    sys.exit(0)
