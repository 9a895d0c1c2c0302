"""Checks of the OpenAI Realtime GA function-call sequence, on raw server and client events (dicts),
shared by pipecat_tool_client.py and livekit_tool_client.py (not a test by itself).

A response that calls (OpenAI Realtime GA, as antiphon's dialect plans it):
response.created, [a spoken message item first, when the text before the tag is spoken],
response.output_item.added (function_call, status in_progress, arguments ""),
conversation.item.added (the same item: pipecat records the call from it, LiveKit asserts its
call_id, name and arguments), response.function_call_arguments.delta (one or more, adding up to
the arguments), response.function_call_arguments.done (name, call_id, arguments),
conversation.item.done, response.output_item.done (status completed), response.done (completed,
its output listing the items, the call last).

antiphon's test-only way to make synthetic weights call: an assistant message item with
"status": "incomplete" created last before response.create begins the response (prefill_item).

Also the two clients' shared plumbing: a bounded wait on an event (never a sleep) and an espeak-ng
phrase from assets/vad at 24 kHz.
"""
import asyncio
import base64
import json
import os
import struct
import wave


class CheckError(Exception):
    pass


def expect(cond, msg):
    if not cond:
        raise CheckError(msg)


def prefill_text(name, arguments, preamble=""):
    """What the model would have written to call: Qwen3's tag around {"name", "arguments"}."""
    return preamble + "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def prefill_item(text, item_id=None):
    """The antiphon extension: an incomplete assistant message that the next response continues."""
    item = {"type": "message", "role": "assistant", "status": "incomplete",
            "content": [{"type": "output_text", "text": text}]}
    if item_id:
        item["id"] = item_id
    return item


def response_ids(events):
    return [e["response"]["id"] for e in events if e.get("type") == "response.created"]


def response_events(events, rid):
    """One response's events: its response.created to its response.done, with the
    conversation.item.* events sent in between (the other responses' events are left out)."""
    start = next((i for i, e in enumerate(events) if e.get("type") == "response.created" and e["response"]["id"] == rid), None)
    end = next((i for i, e in enumerate(events) if e.get("type") == "response.done" and e["response"]["id"] == rid), None)
    expect(start is not None and end is not None and start < end, f"response {rid}: no response.created ... response.done")
    out = []
    for e in events[start:end + 1]:
        t = e.get("type", "")
        if t == "error":
            raise CheckError(f"an error event inside response {rid}: {e}")
        if t.startswith("response.") and t not in ("response.created", "response.done"):
            expect(e.get("response_id") == rid, f"{t} inside response {rid} names response {e.get('response_id')}")
        out.append(e)
    return out


def _idx(evs, ty, item_id):
    def item_of(e):
        return e.get("item_id") or (e.get("item") or {}).get("id")
    return [i for i, e in enumerate(evs) if e["type"] == ty and item_of(e) == item_id]


def _one(evs, ty, item_id):
    found = _idx(evs, ty, item_id)
    expect(len(found) == 1, f"{len(found)} {ty} for item {item_id} (expected one)")
    return found[0]


def _check_id(what, value):
    # OpenAI caps item ids and call ids at 32 characters; LiveKit hashes longer call ids when it
    # replays them, and replays the server's item ids as the client's
    expect(isinstance(value, str) and 0 < len(value) <= 32, f"{what} {value!r}: not a string of 1 to 32 characters")


def check_call_response(evs, name, arguments, spoken=False):
    """Checks a response that calls `name` with `arguments` (a dict); `spoken`: a message item with
    audio comes before the call. Returns {item_id, call_id, arguments (the JSON string), audio_bytes}."""
    types = [e["type"] for e in evs]
    expect(types[0] == "response.created" and types[-1] == "response.done", f"not a whole response: {types}")
    rid = evs[0]["response"]["id"]
    added = [i for i, e in enumerate(evs) if e["type"] == "response.output_item.added"]
    calls = [i for i in added if evs[i]["item"].get("type") == "function_call"]
    expect(len(calls) == 1, f"response {rid}: {len(calls)} function_call items (expected one); events {types}")
    a = calls[0]
    item = evs[a]["item"]
    fid, oi = item.get("id"), evs[a].get("output_index")
    _check_id("the function_call item id", fid)
    _check_id("call_id", item.get("call_id"))
    call_id = item["call_id"]
    expect(item.get("status") == "in_progress", f"output_item.added: status {item.get('status')!r}, expected in_progress")
    expect(item.get("arguments") == "", f"output_item.added: arguments {item.get('arguments')!r}, expected \"\"")
    expect(item.get("name") == name, f"output_item.added: name {item.get('name')!r}, expected {name!r}")

    c = _one(evs, "conversation.item.added", fid)
    citem = evs[c]["item"]
    expect(a < c, "conversation.item.added of the call came before its response.output_item.added")
    expect(citem.get("type") == "function_call" and citem.get("call_id") == call_id and citem.get("name") == name
           and isinstance(citem.get("arguments"), str),
           f"conversation.item.added of the call lacks type/call_id/name/arguments: {citem}")

    deltas = _idx(evs, "response.function_call_arguments.delta", fid)
    expect(deltas, "no response.function_call_arguments.delta")
    expect(min(deltas) > c, "an arguments delta came before conversation.item.added of the call (pipecat keys the call on .added)")
    for i in deltas:
        expect(evs[i].get("call_id") == call_id and evs[i].get("output_index") == oi,
               f"arguments delta with call_id/output_index {evs[i].get('call_id')}/{evs[i].get('output_index')}, expected {call_id}/{oi}")
    d = _one(evs, "response.function_call_arguments.done", fid)
    done = evs[d]
    expect(d > max(deltas), "response.function_call_arguments.done came before a delta")
    expect(done.get("call_id") == call_id and done.get("name") == name and done.get("output_index") == oi,
           f"arguments.done: call_id/name/output_index {done.get('call_id')}/{done.get('name')}/{done.get('output_index')}")
    args = done.get("arguments")
    expect(isinstance(args, str), f"arguments.done: arguments {args!r} is not a string")
    expect("".join(evs[i]["delta"] for i in deltas) == args, "the arguments deltas do not add up to arguments.done's arguments")
    try:
        parsed = json.loads(args)
    except ValueError:
        raise CheckError(f"arguments {args!r} are not JSON")
    expect(parsed == arguments, f"arguments {parsed}, expected {arguments}")

    cd = _one(evs, "conversation.item.done", fid)
    expect(cd > d, "conversation.item.done of the call came before arguments.done")
    ci = evs[cd]["item"]
    expect(ci.get("status") == "completed" and ci.get("arguments") == args and ci.get("call_id") == call_id,
           f"conversation.item.done of the call: {ci}")
    od = _one(evs, "response.output_item.done", fid)
    expect(od > cd, "response.output_item.done of the call came before its conversation.item.done")
    oitem = evs[od]["item"]
    expect(oitem.get("status") == "completed" and oitem.get("arguments") == args and oitem.get("call_id") == call_id
           and oitem.get("name") == name and evs[od].get("output_index") == oi,
           f"response.output_item.done of the call: {evs[od]}")

    resp = evs[-1]["response"]
    expect(resp.get("status") == "completed", f"response.done: status {resp.get('status')!r} ({resp.get('status_details')})")
    output = resp.get("output") or []
    expect(output and output[-1].get("id") == fid and output[-1].get("type") == "function_call",
           f"response.done's output does not end with the call: {[o.get('type') for o in output]}")
    last = output[-1]
    expect(last.get("arguments") == args and last.get("call_id") == call_id and last.get("name") == name
           and last.get("status") == "completed", f"response.done's function_call item: {last}")
    expect(oi == len(output) - 1, f"the call's output_index {oi}, but it is item {len(output) - 1} of response.done")

    audio = [e for e in evs if e["type"] == "response.output_audio.delta"]
    pcm_bytes = sum(len(base64.b64decode(e["delta"])) for e in audio)
    if spoken:
        msgs = [o for o in output[:-1] if o.get("type") == "message"]
        expect(len(msgs) == 1 and msgs[0].get("role") == "assistant", f"a spoken call: output {[o.get('type') for o in output]}")
        mid = msgs[0]["id"]
        expect(audio and all(e.get("item_id") == mid for e in audio), "a spoken call: no audio, or audio of another item")
        expect(_one(evs, "response.output_item.done", mid) < a, "the spoken message item was not done before the call began")
    else:
        expect(len(output) == 1, f"a call alone: output {[o.get('type') for o in output]} (expected the call only)")
        stray = [t for t in types if t.startswith("response.output_audio") or t.startswith("response.content_part")
                 or t.startswith("response.output_text")]
        expect(not stray, f"a call alone has no message, but the response sent {sorted(set(stray))}")
    return {"item_id": fid, "call_id": call_id, "arguments": args, "audio_bytes": pcm_bytes}


def check_answer_response(evs):
    """A spoken response with no call. Returns (PCM bytes, transcript)."""
    types = [e["type"] for e in evs]
    expect(types[0] == "response.created" and types[-1] == "response.done", f"not a whole response: {types}")
    resp = evs[-1]["response"]
    expect(resp.get("status") == "completed", f"response.done: status {resp.get('status')!r} ({resp.get('status_details')})")
    output = resp.get("output") or []
    expect(output and all(o.get("type") == "message" and o.get("role") == "assistant" for o in output),
           f"the answer's output {[o.get('type') for o in output]}, expected assistant messages only")
    ids = {o["id"] for o in output}
    pcm = b""
    for e in evs:
        if e["type"] == "response.output_audio.delta":
            expect(e.get("item_id") in ids, f"audio of item {e.get('item_id')}, not one of the response's {ids}")
            pcm += base64.b64decode(e["delta"])
    expect(len(pcm) > 0 and len(pcm) % 2 == 0, f"the answer has {len(pcm)} bytes of PCM16")
    expect("response.function_call_arguments.done" not in types, "the answer called again")
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_audio_transcript.delta")
    dones = [e for e in evs if e["type"] == "response.output_audio_transcript.done"]
    expect(dones and "".join(e.get("transcript", "") for e in dones) == text, "transcript deltas do not add up to transcript.done")
    return pcm, text


def check_answered(client_events, call_id, output):
    """The client sent function_call_output {call_id, output} and after it a response.create."""
    outs = [i for i, e in enumerate(client_events) if e.get("type") == "conversation.item.create"
            and (e.get("item") or {}).get("type") == "function_call_output"]
    expect(len(outs) == 1, f"the client sent {len(outs)} function_call_output items (expected one)")
    item = client_events[outs[0]]["item"]
    expect(item.get("call_id") == call_id, f"function_call_output for call_id {item.get('call_id')}, expected {call_id}")
    expect(json.loads(item.get("output")) == json.loads(output), f"function_call_output {item.get('output')!r}, expected {output!r}")
    after = [e for e in client_events[outs[0] + 1:] if e.get("type") == "response.create"]
    expect(len(after) == 1, f"{len(after)} response.create after the function_call_output (expected one)")


def check_item_chain(events):
    """Every conversation.item.added names the item before it (previous_item_id) as the tail of the
    conversation so far (null when it is empty), as LiveKit's mirror inserts each item after its
    previous_item_id (at the head when null); conversation.item.deleted removes one. Returns the
    conversation's item ids, in order."""
    ids = []
    for e in events:
        if e.get("type") == "session.created":
            ids = []
        elif e.get("type") == "conversation.item.added":
            iid, prev = e["item"].get("id"), e.get("previous_item_id")
            tail = ids[-1] if ids else None
            expect(prev == tail, f"conversation.item.added {iid} after {prev!r}, but the conversation ends with {tail!r}"
                                 " (an item dropped without conversation.item.deleted, or inserted out of order?)")
            expect(iid not in ids, f"conversation.item.added {iid} twice")
            ids.append(iid)
        elif e.get("type") == "conversation.item.deleted":
            expect(e.get("item_id") in ids, f"conversation.item.deleted of {e.get('item_id')}, not in the conversation")
            ids.remove(e["item_id"])
    return ids


async def wait_until(cond, changed, stopped, timeout):
    """Waits until `cond()` holds or `stopped()` does, waking on the asyncio.Event `changed`;
    False when `timeout` seconds pass first."""
    async def wait():
        while not cond() and not stopped():
            changed.clear()
            await changed.wait()
    try:
        await asyncio.wait_for(wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False


def phrase_24k(name):
    """An espeak-ng phrase from assets/vad at 24 kHz (linear interpolation)."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    w = wave.open(os.path.join(root, "assets", "vad", name))
    rate, n = w.getframerate(), w.getnframes()
    x = struct.unpack(f"<{n}h", w.readframes(n))
    out = []
    for i in range(n * 24000 // rate):
        t = i * rate / 24000
        j = int(t)
        a, b = x[min(j, n - 1)], x[min(j + 1, n - 1)]
        out.append(int(a + (b - a) * (t - j)))
    return out
