#!/usr/bin/env python3
"""Independent edge-case checks of antiphon's OpenAI-Realtime dialect endpoint.

Written only from docs/openai-realtime.md, docs/protocol.md, docs/configuration.md and the
event types of the `openai` Python package. Each check prints PASS/FAIL with evidence.

Checks: 1 reference floods (memory stays bounded), 2 frames over the limit and bad UTF-8 (an
`error`, then close 1009 / 1007), 3 wrong JSON types (`invalid_request_error` naming `param`),
4 what would fail a later response is refused when it arrives, 5 `capacity` says when to retry.
The exit status is 1 when a check fails. Run against a server on this machine (its resident
memory is read from /proc):

    target/release/antiphon serve --listen 127.0.0.1:8095 &
    python3 tests/client/dialect_edges_client.py --url "ws://127.0.0.1:8095/openai/v1/realtime?model=gpt-realtime"
"""
import argparse
import asyncio
import base64
import json
import math
import os
import random
import socket
import struct
import threading
import time
import urllib.parse

import websockets

RESULTS = []


def report(name, ok, evidence):
    tag = "PASS" if ok else "FAIL"
    RESULTS.append((name, tag, evidence))
    print(f"[{tag}] {name}")
    for line in evidence:
        print(f"       {line}")
    print(flush=True)


def short(obj, n=400):
    s = obj if isinstance(obj, str) else json.dumps(obj)
    return s if len(s) <= n else s[:n] + f"...(+{len(s) - n} chars)"


# --------------------------------------------------------------------------- server memory

def find_pid(port):
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"antiphon") and b"serve" in cmd and any(str(port).encode() in c for c in cmd):
            return int(d)
    return None


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


class RssSampler:
    """Samples the server's VmRSS every 20 ms in a thread; reports the peak."""

    def __init__(self, pid):
        self.pid, self.peak, self.stop_flag = pid, 0, False
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop_flag:
            try:
                self.peak = max(self.peak, rss_kib(self.pid) or 0)
            except OSError:
                pass
            time.sleep(0.02)

    def __enter__(self):
        self.peak = rss_kib(self.pid)
        self.t.start()
        return self

    def __exit__(self, *a):
        self.stop_flag = True
        self.t.join()


# --------------------------------------------------------------------------- websockets client

class Conn:
    def __init__(self, url):
        self.url = url
        self.events = []
        self.cv = asyncio.Condition()
        self.closed = None  # (code, reason) or ("no close frame", ...)
        self.n = 0

    async def open(self):
        self.ws = await websockets.connect(self.url, max_size=None, open_timeout=30, ping_interval=None)
        self.reader = asyncio.create_task(self._read())
        ev = await self.wait(lambda e: e.get("type") in ("session.created", "error"), 30)
        if ev is None or ev["type"] != "session.created":
            raise RuntimeError(f"no session.created: {ev}")
        self.session = ev["session"]
        return self

    async def _read(self):
        try:
            async for msg in self.ws:
                if isinstance(msg, bytes):
                    ev = {"type": "<binary>", "len": len(msg)}
                else:
                    ev = json.loads(msg)
                ev["_t"] = time.monotonic()
                async with self.cv:
                    self.events.append(ev)
                    self.cv.notify_all()
        except websockets.ConnectionClosed:
            pass
        finally:
            rc = self.ws.protocol.close_rcvd
            self.closed = (rc.code, rc.reason) if rc is not None else ("no close frame", None)
            async with self.cv:
                self.cv.notify_all()

    async def send(self, obj):
        self.n += 1
        obj.setdefault("event_id", f"evt_{self.n}")
        await self.ws.send(json.dumps(obj, separators=(",", ":")))
        return obj["event_id"], len(self.events)

    async def wait(self, pred, timeout, start=0):
        """First event at index >= start that satisfies pred, or None."""
        deadline = time.monotonic() + timeout
        idx = start
        async with self.cv:
            while True:
                while idx < len(self.events):
                    if pred(self.events[idx]):
                        return self.events[idx]
                    idx += 1
                if self.closed is not None:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(self.cv.wait(), left)
                except asyncio.TimeoutError:
                    pass

    def since(self, start, types=None):
        return [e for e in self.events[start:] if types is None or e.get("type") in types]

    async def close(self):
        try:
            await self.ws.close()
        except Exception:
            pass
        try:
            await asyncio.wait_for(self.reader, 5)
        except Exception:
            pass


def err_of(ev):
    return ev.get("error", {}) if ev else {}


def types_of(evs):
    return [e.get("type") for e in evs]


async def no_turn_detection(c):
    eid, st = await c.send({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    ev = await c.wait(lambda e: e["type"] in ("session.updated", "error"), 20, st)
    assert ev and ev["type"] == "session.updated", f"could not turn VAD off: {ev}"


async def run_response(c, timeout=240, **resp):
    """Adds a user text item and asks for a response; returns (response.done event or None, events)."""
    st = len(c.events)
    await c.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say something short."}]}})
    body = {"type": "response.create"}
    if resp:
        body["response"] = resp
    await c.send(body)
    done = await c.wait(lambda e: e["type"] == "response.done", timeout, st)
    return done, c.since(st)


def done_summary(done):
    if done is None:
        return "no response.done"
    r = done.get("response", {})
    return f"status={r.get('status')} status_details={short(r.get('status_details'), 300)}"


# --------------------------------------------------------------------------- check 1

async def check1(url, pid):
    # (4 KB: a user item of 20 KB is more text than one turn of the tiny model holds, refused when
    # it arrives since issue 38; check 1b covers it)
    big = ("lorem ipsum dolor sit amet " * 800)[:4000]
    for n in (70, 500, 7000):
        name = f"1. memory amplification: response.create with {n} item_references to one 4 KB item"
        c = await Conn(url).open()
        try:
            await no_turn_detection(c)
            eid, st = await c.send({"type": "conversation.item.create", "item": {
                "id": "b", "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": big}]}})
            ev = await c.wait(lambda e: e["type"] in ("conversation.item.done", "conversation.item.added", "error"), 20, st)
            if not ev or ev["type"] == "error":
                report(name, False, [f"could not create the 4 KB item (id 'b'): {short(ev)}"])
                continue
            await asyncio.sleep(0.5)
            payload = {"type": "response.create", "event_id": "amp",
                       "response": {"input": [{"type": "item_reference", "id": "b"}] * n}}
            frame = json.dumps(payload, separators=(",", ":"))
            st = len(c.events)
            rss0 = rss_kib(pid)
            t0 = time.monotonic()
            with RssSampler(pid) as s:
                await c.ws.send(frame)
                ev = await c.wait(lambda e: e["type"] in ("error", "response.created", "response.done"), 60, st)
                dt = time.monotonic() - t0
                started = ev is not None and ev["type"] == "response.created"
                done = None
                if started:
                    # give it a few seconds to fail on its own, then cancel it
                    done = await c.wait(lambda e: e["type"] == "response.done", 10, st)
                    if done is None:
                        await c.send({"type": "response.cancel"})
                        done = await c.wait(lambda e: e["type"] == "response.done", 60, st)
                await asyncio.sleep(0.3)
            rss1 = rss_kib(pid)
            grow = (s.peak - rss0) / 1024
            ev_desc = short(ev, 500)
            refused = ev is not None and ev["type"] == "error"
            failed_done = done is not None and done["response"].get("status") == "failed"
            msg = (err_of(ev).get("message") or "") if refused else ""
            evidence = [f"frame {len(frame)} bytes; first reply after {dt:.2f}s: {ev_desc}",
                        f"VmRSS before {rss0/1024:.1f} MiB, peak {s.peak/1024:.1f} MiB (+{grow:.1f}), after {rss1/1024:.1f} MiB"]
            if started:
                evidence.append(f"a response STARTED; its end: {done_summary(done)}")
            if c.closed:
                evidence.append(f"socket closed: {c.closed}")
            ok = refused and dt < 5 and grow < 200 and bool(msg)
            if not ok and started and failed_done and grow < 200:
                evidence.append("(not refused at arrival: accepted, then reported failed)")
            report(name, ok, evidence)
        finally:
            await c.close()


async def check1b(url):
    """A user item longer than one turn holds: refused when it arrives (naming the item), or accepted
    and answered; accepted and then failing the response is the finding."""
    name = "1b. a 20 KB user text item: refused on arrival, or accepted and answered"
    c = await Conn(url).open()
    try:
        await no_turn_detection(c)
        text = ("lorem ipsum dolor sit amet " * 800)[:20000]
        eid, st = await c.send({"type": "conversation.item.create", "item": {
            "id": "long", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
        ev = await c.wait(lambda e: e["type"] in ("conversation.item.done", "error"), 20, st)
        if ev is not None and ev["type"] == "error":
            e = err_of(ev)
            report(name, bool(e.get("message")) and e.get("param") == "item.content", [f"refused on arrival: {short(ev)}"])
            return
        eid, st = await c.send({"type": "response.create"})
        done = await c.wait(lambda e: e["type"] == "response.done", 60, st)
        status = done["response"].get("status") if done else None
        report(name, status == "completed", [f"accepted; the response: {done_summary(done)}"])
    finally:
        await c.close()


# --------------------------------------------------------------------------- check 2 (raw socket)

class RawWS:
    """A minimal WebSocket client over a plain socket, so frames of any size/content can be sent."""

    def __init__(self, url):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.path = u.path + ("?" + u.query if u.query else "")
        self.sock = socket.create_connection((self.host, self.port), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        req = (f"GET {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(req.encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = self.sock.recv(4096)
            if not d:
                raise RuntimeError(f"handshake EOF: {buf!r}")
            buf += d
        head, self.buf = buf.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise RuntimeError(f"handshake refused: {head!r}")
        self.frames = []  # (opcode, payload, t)
        self.end = None   # how the TCP stream ended
        self.lock = threading.Condition()

    def _read_exact(self, n):
        while len(self.buf) < n:
            d = self.sock.recv(65536)
            if not d:
                raise EOFError
            self.buf += d
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_frame(self):
        b0, b1 = self._read_exact(2)
        op, ln = b0 & 0x0F, b1 & 0x7F
        if ln == 126:
            ln = struct.unpack(">H", self._read_exact(2))[0]
        elif ln == 127:
            ln = struct.unpack(">Q", self._read_exact(8))[0]
        if b1 & 0x80:
            self._read_exact(4)
        return op, self._read_exact(ln)

    def reader(self):
        try:
            while True:
                op, p = self.read_frame()
                with self.lock:
                    self.frames.append((op, p, time.monotonic()))
                    self.lock.notify_all()
                if op == 8:
                    try:  # answer the close
                        self.sock.sendall(self.header(8, len(p)) + p)
                    except OSError:
                        pass
        except EOFError:
            self.end = "EOF (FIN)"
        except ConnectionResetError:
            self.end = "connection reset (RST)"
        except socket.timeout:
            self.end = "read timeout (still open)"
        except OSError as e:
            self.end = f"OSError {e}"
        with self.lock:
            self.lock.notify_all()

    @staticmethod
    def header(op, n):
        h = bytes([0x80 | op])
        if n < 126:
            h += bytes([0x80 | n])
        elif n < 65536:
            h += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            h += bytes([0x80 | 127]) + struct.pack(">Q", n)
        return h + b"\0\0\0\0"  # mask key 0: the payload goes as is

    def texts(self):
        return [json.loads(p) for op, p, _ in self.frames if op == 1]

    def close_frame(self):
        for op, p, _ in self.frames:
            if op == 8:
                if len(p) >= 2:
                    return struct.unpack(">H", p[:2])[0], p[2:].decode("utf-8", "replace")
                return "close frame without code", None
        return None


def frame_case(url, name, op, payload, want_code):
    ws = RawWS(url)
    ws.sock.settimeout(30)
    # first the session.created
    op0, p0 = ws.read_frame()
    first = json.loads(p0)
    ws.sock.settimeout(20)
    rt = threading.Thread(target=ws.reader, daemon=True)
    rt.start()
    send_err = None
    t0 = time.monotonic()
    head = ws.header(op, len(payload))
    refused_at_header = None
    try:
        ws.sock.sendall(head + payload[:1024])
        if len(payload) > 1024:
            # the frame should be refused as its header arrives: wait for that before sending the rest
            with ws.lock:
                ws.lock.wait_for(lambda: any(f[0] == 8 for f in ws.frames) or ws.end, 3)
                refused_at_header = any(f[0] == 8 for f in ws.frames)
            for i in range(1024, len(payload), 65536):
                ws.sock.sendall(payload[i:i + 65536])
    except OSError as e:
        send_err = repr(e)
    rt.join(25)
    texts = ws.texts()
    cf = ws.close_frame()
    errs = [t for t in texts if t.get("type") == "error"]
    ev = [f"sent: opcode {op}, {len(payload)} bytes (first event was {first.get('type')})",
          f"received text events: {[short(t, 300) for t in texts]}",
          f"close frame: {cf}; TCP end: {ws.end}; send error: {send_err}"]
    if refused_at_header is not None:
        ev.append(f"refused while only the header + 1 KiB had been sent: {refused_at_header}")
    close_i = next((i for i, f in enumerate(ws.frames) if f[0] == 8), None)
    err_i = next((i for i, f in enumerate(ws.frames) if f[0] == 1 and json.loads(f[1]).get("type") == "error"), None)
    ok = bool(errs) and cf is not None and cf[0] == want_code and err_i is not None and close_i is not None and err_i < close_i
    report(name, ok, ev)
    try:
        ws.sock.close()
    except OSError:
        pass


async def check2(url):
    loop = asyncio.get_running_loop()

    def text_of(n):
        pre = b'{"type":"input_audio_buffer.append","event_id":"big","audio":"'
        post = b'"}'
        return pre + b"A" * (n - len(pre) - len(post)) + post

    cases = [
        ("2a. text frame of 262145 bytes (limit+1) -> error + close 1009", 1, text_of(262145), 1009),
        ("2b. text frame of 2 MiB -> error + close 1009", 1, text_of(2 * 1024 * 1024), 1009),
        ("2c. binary frame of 300 KB -> error + close 1009", 2, os.urandom(300 * 1000), 1009),
        ("2d. text frame with invalid UTF-8 -> error + close 1007", 1,
         b'{"type":"input_audio_buffer.clear","event_id":"bad","x":"\xff\xfe\xc3"}', 1007),
    ]
    for name, op, payload, code in cases:
        try:
            await loop.run_in_executor(None, frame_case, url, name, op, payload, code)
        except Exception as e:
            report(name, False, [f"client exception: {e!r}"])
        await asyncio.sleep(0.5)
    # control: a text frame of exactly the limit is accepted
    name = "2e. (control) text frame of exactly 262144 bytes is accepted"
    c = await Conn(url).open()
    try:
        await no_turn_detection(c)
        st = len(c.events)
        await c.ws.send(text_of(262144).decode())
        await c.send({"type": "input_audio_buffer.clear"})
        ev = await c.wait(lambda e: e["type"] in ("input_audio_buffer.cleared", "error"), 20, st)
        report(name, ev is not None and c.closed is None and ev["type"] == "input_audio_buffer.cleared",
               [f"events: {[short(e, 300) for e in c.since(st)]}", f"closed: {c.closed}"])
    finally:
        await c.close()


# --------------------------------------------------------------------------- check 3

def is_type_error(ev, param_word):
    e = err_of(ev)
    return (ev is not None and ev.get("type") == "error" and e.get("type") == "invalid_request_error"
            and param_word in (e.get("param") or ""))


async def check3(url):
    cases = [
        ("3a. session.update tool_choice: 5", "tool_choice",
         {"type": "session.update", "session": {"type": "realtime", "tool_choice": 5}}, ("session.updated",)),
        ("3b. session.update turn_detection.eagerness: 7", "eagerness",
         {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
             "turn_detection": {"type": "semantic_vad", "eagerness": 7}}}}}, ("session.updated",)),
        ("3c. conversation.item.create item.type: 5", "type",
         {"type": "conversation.item.create", "item": {"type": 5, "role": "user",
                                                        "content": [{"type": "input_text", "text": "hi"}]}},
         ("conversation.item.added", "conversation.item.done")),
        ("3d. function_call item with arguments as an object", "arguments",
         {"type": "conversation.item.create", "item": {"type": "function_call", "name": "f", "call_id": "call_1",
                                                        "arguments": {"a": 1}}},
         ("conversation.item.added", "conversation.item.done")),
        ("3e. conversation.item.create previous_item_id: 5", "previous_item_id",
         {"type": "conversation.item.create", "previous_item_id": 5,
          "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}},
         ("conversation.item.added", "conversation.item.done")),
        ("3f. assistant output_audio content with transcript: 5", "transcript",
         {"type": "conversation.item.create", "item": {"type": "message", "role": "assistant",
                                                        "content": [{"type": "output_audio", "transcript": 5}]}},
         ("conversation.item.added", "conversation.item.done")),
        ("3g. user input_audio content with transcript: 5", "transcript",
         {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
             {"type": "input_audio", "audio": base64.b64encode(b"\0\0" * 4800).decode(), "transcript": 5}]}},
         ("conversation.item.added", "conversation.item.done")),
        ("3h. response.create response.audio: \"x\"", "audio",
         {"type": "response.create", "response": {"audio": "x"}}, ("response.created",)),
        ("3i. response.create response.audio.output.voice: 5", "voice",
         {"type": "response.create", "response": {"audio": {"output": {"voice": 5}}}}, ("response.created",)),
        ("3j. session.update session.audio: \"x\"", "audio",
         {"type": "session.update", "session": {"type": "realtime", "audio": "x"}}, ("session.updated",)),
    ]
    c = await Conn(url).open()
    try:
        await no_turn_detection(c)
        for name, word, body, forbidden in cases:
            eid, st = await c.send(body)
            ev = await c.wait(lambda e: e["type"] == "error" or e["type"] in forbidden, 15, st)
            await asyncio.sleep(0.5)
            bad = c.since(st, forbidden)
            ok = is_type_error(ev, word) and not bad and err_of(ev).get("event_id") == eid
            evidence = [f"sent: {short(body, 300)}", f"got: {short(ev, 400)}"]
            if bad:
                evidence.append(f"but it also took effect: {[short(e, 200) for e in bad]}")
                if "response.created" in types_of(bad):
                    await c.send({"type": "response.cancel"})
                    await c.wait(lambda e: e["type"] == "response.done", 60, st)
            if c.closed:
                evidence.append(f"socket closed: {c.closed}")
                report(name, False, evidence)
                c = await Conn(url).open()
                await no_turn_detection(c)
                continue
            report(name, ok, evidence)

        # response.cancel with response_id: 5 while a response runs
        name = "3k. response.cancel response_id: 5 during a running response (must error, must not cancel)"
        st = len(c.events)
        await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}})
        await c.send({"type": "response.create"})
        created = await c.wait(lambda e: e["type"] in ("response.created", "error"), 60, st)
        if not created or created["type"] != "response.created":
            report(name, False, [f"no response started: {short(created)}"])
        else:
            st2 = len(c.events)
            eid, _ = await c.send({"type": "response.cancel", "response_id": 5})
            ev = await c.wait(lambda e: e["type"] == "error", 15, st2)
            done = await c.wait(lambda e: e["type"] == "response.done", 240, st)
            already_done = any(e["type"] == "response.done" for e in c.events[st:st2])
            status = done["response"]["status"] if done else None
            ok = is_type_error(ev, "response_id") and status == "completed" and not already_done
            report(name, ok, [f"error: {short(ev, 400)}", f"response: {done_summary(done)}",
                              f"response had finished before the cancel was sent: {already_done}"])
    finally:
        await c.close()


# --------------------------------------------------------------------------- check 4

def prose(n, seed=1):
    rnd = random.Random(seed)
    words = ("the river carried small boats past old houses while children watched from bridges and "
             "merchants counted coins under awnings painted green yellow and red near the market square").split()
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rnd.choice(words))
    return " ".join(out)[:n]


async def later_response_ok(c, label):
    done, evs = await run_response(c)
    status = done["response"]["status"] if done else None
    errs = [short(e, 300) for e in evs if e["type"] == "error"]
    return status == "completed", f"later response ({label}): {done_summary(done)}; errors meanwhile: {errs}"


async def check4(url):
    # 4a: a system item of 9000 characters
    name = "4a. system item of 9000 characters: refused on arrival, later response not failed"
    c = await Conn(url).open()
    try:
        await no_turn_detection(c)
        text = prose(9000)
        eid, st = await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "system", "content": [{"type": "input_text", "text": text}]}})
        ev = await c.wait(lambda e: e["type"] in ("error", "conversation.item.done"), 15, st)
        await asyncio.sleep(0.5)
        ok_later, later = await later_response_ok(c, "after the system item")
        refused = ev is not None and ev["type"] == "error"
        report(name, refused and ok_later,
               [f"on arrival: {short(ev, 400)}", later])
    finally:
        await c.close()

    # 4b: instructions of 2000 chars + a system item of 600
    name = "4b. instructions 2000 chars + system item 600 chars: refused on arrival or served whole; later response not failed"
    c = await Conn(url).open()
    try:
        await no_turn_detection(c)
        eid, st = await c.send({"type": "session.update", "session": {"type": "realtime", "instructions": prose(2000, 2)}})
        ev0 = await c.wait(lambda e: e["type"] in ("error", "session.updated"), 15, st)
        eid, st = await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "system", "content": [{"type": "input_text", "text": prose(600, 3)}]}})
        ev = await c.wait(lambda e: e["type"] in ("error", "conversation.item.done"), 15, st)
        await asyncio.sleep(0.5)
        ok_later, later = await later_response_ok(c, "after instructions + system item")
        report(name, ok_later and ev is not None,
               [f"instructions update: {short(ev0, 200)}", f"system item on arrival: {short(ev, 300)}", later])
    finally:
        await c.close()

    # 4c/4d: commits of one sample and of 50 ms
    for label, nbytes in (("one sample", 2), ("50 ms (1200 samples)", 2400)):
        name = f"4{'c' if nbytes == 2 else 'd'}. input_audio_buffer.commit of {label}: refused on arrival, later response not failed"
        c = await Conn(url).open()
        try:
            await no_turn_detection(c)
            st = len(c.events)
            await c.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x10\x00" * (nbytes // 2)).decode()})
            eid, _ = await c.send({"type": "input_audio_buffer.commit"})
            ev = await c.wait(lambda e: e["type"] in ("error", "input_audio_buffer.committed"), 15, st)
            await asyncio.sleep(0.5)
            # then a real turn: 1 s of a tone, committed, and a response
            pcm = b"".join(struct.pack("<h", int(6000 * math.sin(2 * math.pi * 220 * i / 24000))) for i in range(24000))
            st2 = len(c.events)
            await c.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
            await c.send({"type": "input_audio_buffer.commit"})
            com = await c.wait(lambda e: e["type"] in ("error", "input_audio_buffer.committed"), 15, st2)
            await c.send({"type": "response.create"})
            done = await c.wait(lambda e: e["type"] == "response.done", 240, st2)
            status = done["response"]["status"] if done else None
            refused = ev is not None and ev["type"] == "error"
            report(name, refused and status == "completed" and com and com["type"] == "input_audio_buffer.committed",
                   [f"on arrival: {short(ev, 400)}", f"the next 1 s commit: {short(com, 200)}",
                    f"later response: {done_summary(done)}",
                    f"errors after: {[short(e, 200) for e in c.since(st2, ('error',))]}"])
        finally:
            await c.close()


# --------------------------------------------------------------------------- check 5

async def check5(url):
    name = "5. capacity refusal carries retry_after_ms"
    conns, evidence, refusal = [], [], None
    try:
        for i in range(40):
            try:
                ws = await websockets.connect(url, max_size=None, open_timeout=30, ping_interval=None)
            except Exception as e:
                evidence.append(f"connection {i + 1}: upgrade refused: {e!r}")
                refusal = ("http", repr(e))
                break
            msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if msg.get("type") == "session.created":
                conns.append(ws)
                continue
            code = None
            try:
                await asyncio.wait_for(ws.recv(), 10)
            except websockets.ConnectionClosed:
                code = ws.protocol.close_rcvd.code if ws.protocol.close_rcvd else "no close frame"
            except asyncio.TimeoutError:
                code = "still open after 10 s"
            evidence.append(f"connection {i + 1}: {short(msg, 500)}; close: {code}")
            refusal = ("event", msg, code)
            break
        evidence.insert(0, f"{len(conns)} sessions opened before the refusal")
        if refusal is None:
            report(name, False, evidence + ["no capacity refusal provoked with 40 sessions"])
        elif refusal[0] == "event":
            msg = refusal[1]
            e = err_of(msg)
            has = "retry_after_ms" in e or "retry_after_ms" in msg
            report(name, msg.get("type") == "error" and e.get("code") == "capacity" and has and refusal[2] == 1013, evidence)
        else:
            report(name, False, evidence + ["refused at HTTP level, no retry hint visible to the client"])
    finally:
        for ws in conns:
            await ws.close()


# --------------------------------------------------------------------------- main

async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="ws://127.0.0.1:8095/openai/v1/realtime?model=gpt-realtime")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--only", default="1,1b,2,3,4,5")
    a = ap.parse_args()
    port = urllib.parse.urlparse(a.url).port
    pid = a.pid or find_pid(port)
    print(f"server pid {pid}, url {a.url}\n")
    only = set(a.only.split(","))
    for k, fn in (("1", lambda: check1(a.url, pid)), ("1b", lambda: check1b(a.url)), ("2", lambda: check2(a.url)), ("3", lambda: check3(a.url)),
                  ("4", lambda: check4(a.url)), ("5", lambda: check5(a.url))):
        if k in only:
            try:
                await fn()
            except Exception as e:
                report(f"{k}. (check crashed)", False, [repr(e)])
            await asyncio.sleep(1)
    print("=" * 60)
    for n, t, _ in RESULTS:
        print(f"{t}  {n}")
    print(f"{sum(t == 'PASS' for _, t, _ in RESULTS)} PASS, {sum(t == 'FAIL' for _, t, _ in RESULTS)} FAIL")
    return any(t == "FAIL" for _, t, _ in RESULTS)


if __name__ == "__main__":
    raise SystemExit(1 if asyncio.run(main()) else 0)
