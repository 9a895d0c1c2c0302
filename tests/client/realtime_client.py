#!/usr/bin/env python3
"""An independent client of antiphon's wire protocol v1, written from the protocol description
(docs/protocol.md) alone -- it shares no code with the server. It checks, against a running server:

1. a basic exchange (session.create, input.text, events and audio with gapless seq, the last-packet
   flag, response.done, ping/pong, session.close);
2. N forced drops (the socket is cut mid-response without a close frame, the session is resumed
   with the highest seq held, and every message arrives exactly once);
3. bad input (bad JSON, unknown events, missing fields, truncated frames, undecodable Opus,
   oversized frames) never ends the session;
4. response.cancel stops the audio within 500 ms;
5. a duplex session (speak_every 2) fed 10 s of audio and 1 s of trailing silence in real time:
   listen/speak for every unit, a response per spoken unit, gapless seq, and a socket dropped
   mid-speech, resumed, with the unacknowledged input resent -- nothing lost, nothing doubled.

    python3 tests/client/realtime_client.py ws://127.0.0.1:8080/v1/realtime [--drops 20]

Needs the `websockets` package. Exits non-zero on the first failed check.
"""
import argparse
import asyncio
import json
import random
import struct
import sys
import time

import websockets

HEADER = struct.Struct("<BBHII")  # kind, flags, reserved, seq, response_id


def frame(kind, seq, payload, flags=0, response_id=0):
    return HEADER.pack(kind, flags, 0, seq, response_id) + payload


def resume_url(url, sid):
    """A resume connects with the session id in the URL too, so a proxy can route it."""
    from urllib.parse import quote
    return url + ("&" if "?" in url else "?") + "session_id=" + quote(sid, safe="")


class Conn:
    def __init__(self, ws):
        self.ws = ws

    @classmethod
    async def open(cls, url):
        return cls(await websockets.connect(url, max_size=None))

    async def send(self, obj):
        await self.ws.send(json.dumps(obj))

    async def recv(self, timeout=60):
        """('event', dict) | ('audio', dict) | ('closed', code)"""
        try:
            m = await asyncio.wait_for(self.ws.recv(), timeout)
        except websockets.ConnectionClosed as e:
            return ("closed", e.rcvd.code if e.rcvd else None)
        if isinstance(m, bytes):
            kind, flags, _, seq, rid = HEADER.unpack(m[:12])
            return ("audio", {"kind": kind, "last": bool(flags & 1), "seq": seq, "response_id": rid, "payload": m[12:]})
        return ("event", json.loads(m))

    async def until(self, pred, timeout=60):
        out = []
        while True:
            m = await self.recv(timeout)
            out.append(m)
            if m[0] == "closed" or pred(m):
                return out

    async def event(self, ty, timeout=60):
        ms = await self.until(lambda m: m[0] == "event" and m[1]["type"] == ty, timeout)
        last = ms[-1]
        check(last[0] == "event" and last[1]["type"] == ty, f"expected {ty}, got {ms[-3:]}")
        return last[1]

    async def close(self):
        await self.ws.close()

    def cut(self):
        """Drop the TCP connection without a WebSocket close frame."""
        self.ws.transport.abort()


def check(cond, what):
    if not cond:
        print("FAIL:", what)
        sys.exit(1)


def seq_of(m):
    if m[0] == "event":
        return m[1].get("seq")
    if m[0] == "audio":
        return m[1]["seq"]
    return None


def is_done(m):
    return m[0] == "event" and m[1]["type"] == "response.done"


CREATE = {"type": "session.create", "mode": "turn", "input_audio": {"codec": "pcm16", "sample_rate": 16000},
          "output_audio": {"codec": "opus", "frame_ms": 20}}


def gen(codes):
    return {"min_text_tokens": 4, "max_text_tokens": 4, "min_audio_tokens": codes, "max_audio_tokens": codes, "seed": 3}


async def basic(url):
    c = await Conn.open(url)
    await c.send(CREATE)
    created = await c.event("session.created")
    check(created["seq"] == 1 and created["protocol"] == 1, f"session.created: {created}")
    check(isinstance(created["session_id"], str) and isinstance(created["resume_token"], str), "ids")
    await c.send({"type": "input.text", "text": "Hello there", "seq": 1, "generation": gen(30)})
    ms = await c.until(is_done)
    seqs = [seq_of(m) for m in ms if seq_of(m) is not None]
    check(seqs == list(range(2, 2 + len(seqs))), f"gapless seq after session.created: {seqs[:10]}...")
    check(ms[0][0] == "event" and ms[0][1]["type"] == "response.created", "response.created first")
    audio = [m[1] for m in ms if m[0] == "audio"]
    check(len(audio) > 0 and all(a["kind"] == 1 for a in audio), "audio frames")
    rid = ms[0][1]["response_id"]
    check(all(a["response_id"] == rid for a in audio), "audio carries the response id")
    check(audio[-1]["last"] and sum(a["last"] for a in audio) == 1, "exactly the last packet is flagged")
    done = ms[-1][1]
    check(done["status"] == "completed" and done["packets"] == len(audio), f"response.done: {done}")
    check(done["audio_ms"] == 20 * len(audio), "audio_ms = 20 ms per Opus packet")
    await c.send({"type": "ack", "seq": seqs[-1]})
    await c.send({"type": "ping", "id": 42})
    pong = await c.event("pong")
    check(pong.get("id") == 42 and "seq" not in pong, "pong is connection-level")
    await c.send({"type": "session.close"})
    m = await c.recv(10)
    check(m[0] == "closed", "closed after session.close")
    print(f"ok   basic exchange: {len(audio)} packets, seq 1..{seqs[-1]} gapless")


async def drops(url, n, rng):
    for i in range(n):
        c = await Conn.open(url)
        await c.send(CREATE)
        created = await c.event("session.created")
        sid, tok = created["session_id"], created["resume_token"]
        held = {1}
        await c.send({"type": "input.text", "text": f"drop test {i}", "seq": 1, "generation": gen(30)})
        cut = rng.randint(1, 70)
        finished = False
        for _ in range(cut):
            m = await c.recv()
            if seq_of(m) is not None:
                check(seq_of(m) not in held, f"duplicate seq {seq_of(m)} before the drop")
                held.add(seq_of(m))
            if is_done(m):
                finished = True
                break
        c.cut()
        last = max(held)
        c = await Conn.open(resume_url(url, sid))
        await c.send({"type": "session.resume", "session_id": sid, "resume_token": tok, "last_seq": last})
        r = await c.event("session.resumed")
        check("seq" not in r and r["input_seq"] == 1, f"session.resumed: {r}")
        if not finished:
            for m in await c.until(is_done):
                s = seq_of(m)
                if s is not None:
                    check(s not in held, f"duplicate seq {s} after the resume (drop {i}, cut {cut})")
                    held.add(s)
        check(sorted(held) == list(range(1, max(held) + 1)), f"lost messages (drop {i}, cut {cut})")
        await c.send({"type": "session.close"})
        await c.close()
    print(f"ok   {n} forced drops: every message exactly once")


async def bad_input(url):
    c = await Conn.open(url)
    await c.send({"type": "input.text", "text": "too early"})
    check((await c.event("error"))["code"] == "not_in_session", "not_in_session")
    await c.send(dict(CREATE, input_audio={"codec": "opus", "sample_rate": 16000}))
    await c.event("session.created")
    cases = [
        ("{broken", "bad_json"),
        (json.dumps({"type": "teleport"}), "unknown_event"),
        (json.dumps({"type": "input.text"}), "bad_field"),
        (json.dumps({"type": "playback", "response_id": 1}), "bad_field"),
        (frame(1, 0, b"")[:7], "bad_audio"),
        (frame(1, 0, bytes([0xFF] * 40)), "bad_audio"),  # code-3 packet with an impossible frame count
    ]
    for payload, code in cases:
        await c.ws.send(payload)
        e = await c.event("error")
        check(e["code"] == code and e["fatal"] is False, f"{code}: {e}")
    await c.ws.send(frame(77, 0, b"future kind"))  # an unknown kind is ignored
    await c.send({"type": "input.text", "text": "still alive?", "generation": gen(10)})
    ms = await c.until(is_done)
    check(ms[-1][1]["status"] == "completed", "the session survives bad input")
    check(not any(m[0] == "event" and m[1]["type"] == "error" for m in ms), "no error for the unknown kind")
    await c.send({"type": "session.close"})
    # oversized frames: error message_too_large, then close 1009
    big = await Conn.open(url)
    await big.send(CREATE)
    await big.event("session.created")
    await big.ws.send(frame(1, 0, b"\x00" * 20000))
    ms = await big.until(lambda m: False)
    check(any(m[0] == "event" and m[1].get("code") == "message_too_large" for m in ms), f"message_too_large: {ms}")
    check(ms[-1] == ("closed", 1009), f"close 1009: {ms[-1]}")
    print("ok   bad input: every error non-fatal, the session keeps working; oversized -> 1009")


async def cancel(url):
    c = await Conn.open(url)
    await c.send(CREATE)
    await c.event("session.created")
    await c.send({"type": "input.text", "text": "a long story", "generation": gen(500)})
    await c.until(lambda m: m[0] == "audio")
    t0 = time.monotonic()
    await c.send({"type": "response.cancel"})
    ms = await c.until(is_done)
    dt = (time.monotonic() - t0) * 1000
    check(ms[-1][1]["status"] == "cancelled", f"cancelled: {ms[-1]}")
    check(dt < 500, f"cancel took {dt:.0f} ms")
    try:
        m = await asyncio.wait_for(c.ws.recv(), 0.5)
        check(not isinstance(m, bytes), "audio after response.done")
    except asyncio.TimeoutError:
        pass
    await c.send({"type": "session.close"})
    print(f"ok   cancel: response.done cancelled {dt:.0f} ms after response.cancel, no audio after it")


async def duplex(url):
    import math
    units = 11
    rate = 16000
    samples = []
    for i in range(units * rate):
        t = i / rate
        # 10 s of a wavering two-tone "voice", then 1 s of silence
        v = 0.0 if t >= 10 else 0.25 * math.sin(2 * math.pi * (180 + 40 * math.sin(t)) * t) + 0.1 * math.sin(2 * math.pi * 410 * t)
        samples.append(int(v * 32767))
    pcm = struct.pack(f"<{len(samples)}h", *samples)
    frames = [pcm[i * 3200:(i + 1) * 3200] for i in range(units * 10)]  # 100 ms each
    c = await Conn.open(url)
    await c.send({"type": "session.create", "mode": "duplex", "input_audio": {"codec": "pcm16", "sample_rate": rate},
                  "output_audio": {"codec": "opus", "frame_ms": 20}, "duplex": {"policy": "speak_every", "k": 2},
                  "generation": gen(10)})
    created = await c.event("session.created")
    check(created["mode"] == "duplex", f"session.created: {created}")
    sid, tok = created["session_id"], created["resume_token"]
    state = {"conn": c, "next": 0}
    live = asyncio.Event()
    live.set()
    t0 = time.monotonic()

    async def sender():
        while state["next"] < len(frames):
            await live.wait()
            i = state["next"]
            await asyncio.sleep(max(0.0, t0 + 0.1 * i - time.monotonic()))
            if not live.is_set():
                continue
            try:
                await state["conn"].ws.send(frame(1, i + 1, frames[i]))
                state["next"] = i + 1
            except websockets.ConnectionClosed:
                await asyncio.sleep(0.02)

    task = asyncio.create_task(sender())
    held, msgs, audio_of = {1}, [], {}
    dropped, dones, since_ack = False, 0, 0
    while dones < 5:
        m = await state["conn"].recv(60)
        check(m[0] != "closed", f"the duplex socket closed: {m}")
        s = seq_of(m)
        if s is not None:
            check(s not in held, f"duplicate seq {s}")
            held.add(s)
        msgs.append(m)
        dones += is_done(m)
        since_ack += 1
        if since_ack >= 50:
            await state["conn"].send({"type": "ack", "seq": max(held)})
            since_ack = 0
        if m[0] == "audio":
            audio_of.setdefault(m[1]["response_id"], []).append(m[1])
            if not dropped and m[1]["response_id"] == 2 and len(audio_of[2]) == 5:
                # mid-speech: cut the socket, let input pile up, resume, resend what was not applied
                live.clear()
                state["conn"].cut()
                dropped = True
                await asyncio.sleep(0.7)
                c2 = await Conn.open(resume_url(url, sid))
                await c2.send({"type": "session.resume", "session_id": sid, "resume_token": tok, "last_seq": max(held)})
                r = await c2.event("session.resumed")
                check(r["input_seq"] <= state["next"], f"input_seq {r['input_seq']} beyond what was sent")
                state["conn"], state["next"] = c2, r["input_seq"]
                live.set()
    await task
    check(dropped, "the drop happened")
    check(sorted(held) == list(range(1, max(held) + 1)), "gapless seq across the drop: nothing lost")
    events = [m[1] for m in msgs if m[0] == "event"]
    decisions = [(e["unit"], e["type"]) for e in events if e["type"] in ("duplex.listen", "duplex.speak")]
    want = [(u, "duplex.speak" if u % 2 == 1 else "duplex.listen") for u in range(units)]
    check(decisions[:units] == want, f"one decision per unit, speak every 2nd: {decisions}")
    created = [e for e in events if e["type"] == "response.created"]
    done = [e for e in events if e["type"] == "response.done"]
    check(len(created) == 5 and all(e["trigger"] == "duplex" for e in created), f"responses: {created}")
    check(all(d["status"] == "completed" for d in done), f"done: {done}")
    for d in done:
        a = audio_of.get(d["response_id"], [])
        check(a and a[-1]["last"] and sum(x["last"] for x in a) == 1 and d["packets"] == len(a),
              f"response {d['response_id']}: {len(a)} packets, done {d}")
    await state["conn"].send({"type": "session.close"})
    await state["conn"].close()
    packets = sum(len(v) for v in audio_of.values())
    print(f"ok   duplex: {units} units, 5 spoken turns, {packets} packets, seq 1..{max(held)} gapless across a mid-speech drop")


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--drops", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    await basic(a.url)
    await drops(a.url, a.drops, random.Random(a.seed))
    await bad_input(a.url)
    await cancel(a.url)
    await duplex(a.url)
    print("all checks passed")


if __name__ == "__main__":
    asyncio.run(main())
