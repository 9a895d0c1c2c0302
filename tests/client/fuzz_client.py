#!/usr/bin/env python3
"""A fuzzing client for antiphon's wire protocol v1, written from the wire contract alone
(shared/spec/protocol.md); it shares no code with the server. It sends hundreds of seeded random
malformed or hostile inputs, each case on a session of its own (or on a bare socket before any
session), and after every case checks, per the contract:

* the input the protocol refuses got a documented `error` (a stable code; `bad_field` names the
  field; `bad_json` / `unknown_event` / `bad_audio` are never fatal), or the documented close
  (`message_too_large`, then close 1009); valid input got no error;
* a session that got a non-fatal error still works: a valid `input.text` on it completes;
* every server message of a session carries the next `seq` (gapless, from 1), connection-level
  ones (`session.resumed`, `ack`, `pong`, an `error` outside a session) carry none; audio frames
  are well formed and belong to an open response; `response.done` counts its packets;
* the server is still up: a fresh socket creates a session and answers a ping after every case (and
  completes a minimal `input.text` every --full-every cases); a bystander session opened at the
  start keeps working and is never disturbed by other sessions' bad input;
* nothing hangs: every wait has a timeout (--timeout, 20 s); a hang is a failure.

    python3 tests/client/fuzz_client.py ws://127.0.0.1:8080/v1/realtime [--cases 300] [--seed 1]

Needs the `websockets` package (>= 14, for text frames carrying raw bytes). Prints one line per
case category and `fuzz: N cases, F failures`; exits non-zero on any failure, printing each failing
case's input and what was observed.
"""
import argparse
import asyncio
import itertools
import json
import random
import re
import struct
import sys
import time
import traceback

import websockets

HEADER = struct.Struct("<BBHII")  # kind, flags, reserved, seq, response_id
TEXT_LIMIT = 256 * 1024
BINARY_LIMIT = 16 * 1024
CODES = {"bad_json", "unknown_event", "bad_field", "not_in_session", "session_not_found",
         "bad_resume_token", "session_expired", "session_in_use", "capacity", "bad_audio",
         "message_too_large", "journal_overflow", "internal"}
NEVER_FATAL = {"bad_json", "unknown_event", "bad_audio"}  # "(not fatal)", "the session lives"
CONN_LEVEL = {"session.resumed", "ack", "pong"}
CLOSING_REASONS = {"shutdown", "idle", "max_duration", "replaced"}
DONE_STATUS = {"completed", "cancelled", "failed"}
ANY = "any"
ANY_ID = object()  # a pong with any id will do
TIMEOUT = 20.0
ALLOW_REPLACED_SEQ0 = False
TINY = {"max_text_tokens": 1, "min_text_tokens": 1, "max_audio_tokens": 1, "min_audio_tokens": 1, "seed": 1}
SYNC = itertools.count(1)
LIVE = []  # every Conn opened since the last reap
PARENTS = {"max_text_tokens": "generation", "min_text_tokens": "generation", "max_audio_tokens": "generation",
           "min_audio_tokens": "generation", "temperature": "generation", "seed": "generation", "k": "duplex",
           "policy": "duplex", "codec": ("input_audio", "output_audio"), "sample_rate": ("input_audio", "voice"),
           "frame_ms": "output_audio", "id": "voice", "ref_audio_b64": "voice"}


def create_event(codec="pcm16", rate=16000, out="pcm16", **extra):
    ev = {"type": "session.create", "mode": "turn", "input_audio": {"codec": codec, "sample_rate": rate},
          "output_audio": {"codec": out, "frame_ms": 20}}
    ev.update(extra)
    return ev


CREATE = create_event()


class Failure(Exception):
    pass


class Raw:
    """A JSON fragment spliced verbatim into the encoded text (invalid numbers, deep nesting)."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return f"Raw({short(self.text, 60)})"


def dumps(obj, ascii_only=False):
    raws = []

    def walk(o):
        if isinstance(o, Raw):
            raws.append(o.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        return o

    s = json.dumps(walk(obj), ensure_ascii=ascii_only, separators=(",", ":"))
    for i, r in enumerate(raws):
        s = s.replace(f'"\\u0000raw{i}\\u0000"', r, 1)
    return s


def short(x, n=240):
    if isinstance(x, (bytes, bytearray)):
        h = bytes(x[:48]).hex()
        return f"<{len(x)} bytes: {h}{'…' if len(x) > 48 else ''}>"
    s = x if isinstance(x, str) else repr(x)
    return s if len(s) <= n else f"{s[:n]}… ({len(s)} chars)"


def frame(kind, seq, payload, flags=0, response_id=0, reserved=0):
    return HEADER.pack(kind, flags, reserved, seq, response_id) + payload


class TextBytes:
    """A text frame whose payload is raw bytes (invalid UTF-8 on purpose)."""

    def __init__(self, data):
        self.data = data

    def __repr__(self):
        return f"text-frame{short(self.data)}"


class Fragments:
    """One message sent as several WebSocket frames (continuation frames)."""

    def __init__(self, parts):
        self.parts = parts

    def __repr__(self):
        total = sum(len(p) for p in self.parts)
        first = self.parts[0] if self.parts else ""
        kind = "binary" if isinstance(first, bytes) else "text"
        return f"{kind} message in {len(self.parts)} fragments, {total} bytes: {short(first, 80)}"


def describe(item):
    if isinstance(item, (TextBytes, Fragments)):
        return repr(item)
    if isinstance(item, bytes):
        return "binary" + short(item)
    if isinstance(item, str):
        return "text " + short(item)
    return "text " + short(dumps(item))


def json_loads(s):
    try:
        return json.loads(s)
    except RecursionError:
        return Raw("<too deep for this client>")


class Conn:
    """One WebSocket, with every contract check on what the server sends."""

    def __init__(self, ws, label):
        self.ws = ws
        self.label = label
        self.log = []          # ('event', dict) | ('audio', dict) | ('text', str) | ('closed', (code, reason))
        self.violations = []
        self.closed = None
        self.in_session = False
        self.next_seq = None
        self.max_seq = 0
        self.sid = self.token = None
        self.mode = None
        self.resume_last = None
        self.open = {}         # response_id -> {'packets': n, 'last': bool}
        self.finished = set()
        self.we_closed = False
        self.reaped = False
        self.send_failed = False
        self.resumed = False
        LIVE.append(self)

    @classmethod
    async def open_(cls, url, label="", query=""):
        try:
            ws = await asyncio.wait_for(websockets.connect(url + query, max_size=None, compression=None,
                                                           ping_interval=None, close_timeout=2,
                                                           open_timeout=TIMEOUT), TIMEOUT + 1)
        except asyncio.TimeoutError:
            raise Failure(f"hang: the WebSocket upgrade did not complete within {TIMEOUT:.0f} s")
        except (OSError, websockets.InvalidHandshake) as e:
            raise Failure(f"cannot connect ({type(e).__name__}: {e}) -- is the server down?")
        return cls(ws, label)

    def violate(self, what):
        self.violations.append(f"[{self.label}] {what}")

    def _closed(self, exc):
        if self.closed is None:
            rc = getattr(exc, "rcvd", None)
            self.closed = (rc.code, rc.reason) if rc is not None else (None, f"no close frame ({type(exc).__name__})")
            self.log.append(("closed", self.closed))

    async def send(self, item):
        """Send one item (dict / str / bytes / TextBytes / Fragments); False if the socket is gone."""
        if self.closed or self.send_failed:
            return False
        try:
            if isinstance(item, TextBytes):
                coro = self.ws.send(item.data, text=True)
            elif isinstance(item, Fragments):
                coro = self.ws.send(item.parts)
            elif isinstance(item, (str, bytes)):
                coro = self.ws.send(item)
            else:
                coro = self.ws.send(dumps(item))
            await asyncio.wait_for(coro, TIMEOUT)
            return True
        except asyncio.TimeoutError:
            raise Failure(f"hang: a send did not complete within {TIMEOUT:.0f} s (the server stopped reading)")
        except (websockets.ConnectionClosed, OSError):
            # not marked closed here: what the server sent before closing is still to be read,
            # and recv() reports the close frame
            self.send_failed = True
            return False

    async def recv(self, timeout):
        """The next message, or None on timeout; ('closed', …) once the socket is closed."""
        if self.closed:
            return ("closed", self.closed)
        try:
            m = await asyncio.wait_for(self.ws.recv(), max(timeout, 0.001))
        except asyncio.TimeoutError:
            return None
        except websockets.ConnectionClosed as e:
            self._closed(e)
            return ("closed", self.closed)
        except OSError as e:
            self._closed(e)
            return ("closed", self.closed)
        if isinstance(m, bytes):
            entry = ("audio", self._audio(m))
        else:
            entry = self._event(m)
        self.log.append(entry)
        return entry

    async def recv_by(self, deadline, what):
        m = await self.recv(deadline - time.monotonic())
        if m is None:
            raise Failure(f"hang: no {what} within {TIMEOUT:.0f} s")
        return m

    def _seq(self, s, what):
        if not self.in_session:
            self.violate(f"{what} carries seq {s} before any session")
            return
        if not isinstance(s, int) or isinstance(s, bool) or s != self.next_seq:
            self.violate(f"{what}: seq {s!r}, expected {self.next_seq} (one counter per session, +1 per message)")
        if isinstance(s, int) and not isinstance(s, bool):
            self.next_seq = s + 1
            self.max_seq = max(self.max_seq, s)

    def _audio(self, m):
        if len(m) < 12:
            self.violate(f"binary frame of {len(m)} bytes, shorter than the 12-byte header")
            return {"kind": None, "len": len(m)}
        kind, flags, reserved, seq, rid = HEADER.unpack(m[:12])
        a = {"kind": kind, "last": bool(flags & 1), "seq": seq, "response_id": rid, "len": len(m) - 12}
        if kind != 1:
            return a  # reserved kinds: ignored
        if flags & ~1 or reserved:
            self.violate(f"audio frame seq {seq}: flags {flags:#x} / reserved {reserved:#x} not 0")
        self._seq(seq, "audio frame")
        r = self.open.get(rid)
        if r is None and self.resumed and rid not in self.finished:
            # resumed after the response began: its response.created came before last_seq
            r = self.open[rid] = {"packets": 0, "last": False, "t0": time.monotonic(), "cancelled": False, "partial": True}
        if r is None:
            self.violate(f"audio frame seq {seq} for response {rid}, which is not open")
        else:
            if r["last"]:
                self.violate(f"audio frame seq {seq} after the last-packet flag of response {rid}")
            r["packets"] += 1
            r["last"] = r["last"] or a["last"]
        return a

    def _event(self, text):
        try:
            ev = json_loads(text)
        except ValueError:
            self.violate(f"server text frame is not JSON: {short(text)}")
            return ("text", text)
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
            self.violate(f"server text frame is not an event object: {short(text)}")
            return ("text", text)
        ty = ev["type"]
        if ty in CONN_LEVEL or (ty == "error" and not self.in_session):
            if "seq" in ev:
                self.violate(f"connection-level `{ty}` carries seq: {short(text)}")
        elif ty == "session.created" and self.resumed:  # replayed from the journal (last_seq 0)
            self._seq(ev.get("seq"), "replayed session.created")
        elif ty == "session.created":
            if self.in_session:
                self.violate(f"second session.created on one socket: {short(text)}")
            self.in_session = True
            self.next_seq = 1
            self._seq(ev.get("seq"), "session.created")
            for f, t in (("session_id", str), ("resume_token", str), ("mode", str), ("output_audio", dict),
                         ("resume_grace_s", (int, float)), ("limits", dict)):
                if not isinstance(ev.get(f), t):
                    self.violate(f"session.created field `{f}` missing or mistyped: {short(text)}")
            if ev.get("protocol") != 1:
                self.violate(f"session.created protocol is not 1: {short(text)}")
            self.sid, self.token, self.mode = ev.get("session_id"), ev.get("resume_token"), ev.get("mode")
        elif ty == "session.closing" and ev.get("reason") == "replaced" and ev.get("seq") == 0 and ALLOW_REPLACED_SEQ0:
            pass  # antiphon's docs/protocol.md: `replaced` goes to the older socket, connection-level
        else:
            if "seq" not in ev:
                self.violate(f"`{ty}` carries no seq: {short(text)}")
            else:
                self._seq(ev["seq"], f"`{ty}`")
        if ty == "session.resumed":
            if self.in_session:
                self.violate("session.resumed on a socket already in a session")
            if not isinstance(ev.get("input_seq"), int) or not isinstance(ev.get("session_id"), str):
                self.violate(f"session.resumed fields: {short(text)}")
            self.in_session = True
            self.resumed = True
            self.next_seq = (self.resume_last or 0) + 1
        elif ty == "ack":
            if not isinstance(ev.get("input_seq"), int) or isinstance(ev.get("input_seq"), bool):
                self.violate(f"ack without an integer input_seq: {short(text)}")
        elif ty == "error":
            if ev.get("code") not in CODES:
                self.violate(f"error with an undocumented code: {short(text)}")
            if not isinstance(ev.get("fatal"), bool) or not isinstance(ev.get("message"), str):
                self.violate(f"error without bool `fatal` / string `message`: {short(text)}")
            if ev.get("code") == "capacity" and not isinstance(ev.get("retry_after_ms"), (int, float)):
                self.violate(f"`capacity` error without retry_after_ms: {short(text)}")
            # an error about a response names it ("response 3 ..."): its failure has a reason
            m = re.match(r"response (\d+)\b", ev.get("message") or "")
            if m and int(m.group(1)) in self.open:
                self.open[int(m.group(1))]["error"] = True
        elif ty == "response.created":
            rid = ev.get("response_id")
            if rid in self.open or rid in self.finished:
                self.violate(f"response.created reuses response_id {rid}")
            if ev.get("trigger") not in ("text", "commit", "duplex"):
                self.violate(f"response.created trigger: {short(text)}")
            self.open[rid] = {"packets": 0, "last": False, "t0": time.monotonic(), "cancelled": False}
        elif ty == "response.done":
            rid = ev.get("response_id")
            r = self.open.pop(rid, None)
            if r is None and self.resumed and rid not in self.finished:
                r = {"packets": 0, "last": False, "partial": True}
            if r is None:
                self.violate(f"response.done for response {rid}, which is not open")
            else:
                self.finished.add(rid)
                if ev.get("status") not in DONE_STATUS:
                    self.violate(f"response.done status: {short(text)}")
                if ev.get("packets") != r["packets"] and not r.get("partial"):
                    self.violate(f"response.done says {ev.get('packets')} packets, {r['packets']} arrived")
                if ev.get("status") == "completed" and r["packets"] and not r["last"]:
                    self.violate(f"completed response {rid}: no packet carries the last-packet flag")
                if not isinstance(ev.get("audio_ms"), (int, float)):
                    self.violate(f"response.done without audio_ms: {short(text)}")
                if ev.get("status") == "failed" and not r.get("error") and not r.get("partial"):
                    self.violate(f"response {rid} failed with no error event saying why")
        elif ty == "session.closing":
            if ev.get("reason") not in CLOSING_REASONS:
                self.violate(f"session.closing reason: {short(text)}")
        elif ty == "pong":
            pass
        elif ty in ("response.text.delta",):
            if not isinstance(ev.get("text"), str):
                self.violate(f"response.text.delta without text: {short(text)}")
        elif ty in ("duplex.listen", "duplex.speak", "session.created"):
            pass
        else:
            self.violate(f"undocumented server event type `{ty}`")
        return ("event", ev)

    async def settle(self, cancel_after=1.0, linger=0.12):
        """Sync on a ping, let triggered responses finish (cancelling long ones), ack; what arrived."""
        start = len(self.log)
        sync_id = f"sync-{next(SYNC)}"
        deadline = time.monotonic() + TIMEOUT
        sent = await self.send({"type": "ping", "id": sync_id})
        while not self.closed:  # without the ping sent (the socket is closing): read up to the close
            m = await self.recv_by(deadline, "pong for the sync ping (the socket went silent)" if sent
                                   else "close frame after a failed send")
            if m[0] == "event" and m[1].get("type") == "pong" and m[1].get("id") == sync_id:
                break
        end = time.monotonic() + linger
        while not self.closed and time.monotonic() < end:
            if await self.recv(end - time.monotonic()) is None:
                break
        deadline = time.monotonic() + TIMEOUT
        while not self.closed and self.open:
            now = time.monotonic()
            for rid, r in self.open.items():
                if not r["cancelled"] and now - r["t0"] > cancel_after:
                    r["cancelled"] = True
                    deadline = now + TIMEOUT
                    await self.send({"type": "response.cancel", "response_id": rid})
            if now > deadline:
                raise Failure(f"hang: response(s) {sorted(self.open)} not done {TIMEOUT:.0f} s after response.cancel")
            await self.recv(0.2)
        got = self.log[start:]
        if not self.closed and any(m[0] == "event" and m[1].get("type") == "error" and m[1].get("fatal") is True
                                   for m in got):
            wait = min(TIMEOUT, 5.0)  # the close follows the error at once; 5 s is generous
            deadline = time.monotonic() + wait
            while not self.closed:
                if await self.recv(deadline - time.monotonic()) is None:
                    raise Failure(f"a fatal error, but the socket is still open {wait:.0f} s later")
            got = self.log[start:]
        if self.in_session and not self.closed and self.max_seq:
            await self.send({"type": "ack", "seq": self.max_seq})
        return [m for m in got if not (m[0] == "event" and m[1].get("type") == "pong" and m[1].get("id") == sync_id)]

    async def wait_event(self, ty, what=None):
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = await self.recv_by(deadline, what or f"`{ty}`")
            if m[0] == "closed":
                raise Failure(f"socket closed {m[1]} while waiting for `{ty}`; last messages: {summarize(self.log[-4:])}")
            if m[0] == "event" and m[1].get("type") == ty:
                return m[1]

    async def request(self, text="still alive?", generation=None, seq=None, ack=True):
        """A minimal valid input.text; returns the response.done (status completed is checked)."""
        ev = {"type": "input.text", "text": text, "generation": generation or TINY}
        if seq is not None:
            ev["seq"] = seq
        start = len(self.log)
        if not await self.send(ev):
            raise Failure(f"socket closed {self.closed} before a valid input.text")
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = await self.recv_by(deadline, "response.done for a minimal valid input.text")
            if m[0] == "closed":
                raise Failure(f"socket closed {m[1]} during a valid input.text; got {summarize(self.log[start:])}")
            if m[0] == "event" and m[1].get("type") == "response.done":
                break
        got = self.log[start:]
        done = got[-1][1]
        errs = [m[1] for m in got if m[0] == "event" and m[1].get("type") == "error"]
        if done.get("status") != "completed" or errs:
            raise Failure(f"a valid input.text did not complete: {summarize(got)}")
        if not any(m[0] == "audio" and m[1].get("kind") == 1 for m in got):
            raise Failure(f"a valid input.text completed with no audio: {summarize(got)}")
        if ack and self.max_seq:
            await self.send({"type": "ack", "seq": self.max_seq})
        return done

    async def ping(self):
        pid = f"probe-{next(SYNC)}"
        if not await self.send({"type": "ping", "id": pid}):
            raise Failure(f"socket closed {self.closed} before a ping")
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = await self.recv_by(deadline, "pong")
            if m[0] == "closed":
                raise Failure(f"socket closed {m[1]} while waiting for a pong")
            if m[0] == "event" and m[1].get("type") == "pong" and m[1].get("id") == pid:
                return

    async def close_session(self):
        if self.closed:
            return
        self.we_closed = True
        await self.send({"type": "session.close"})
        deadline = time.monotonic() + TIMEOUT
        while not self.closed:
            if await self.recv(deadline - time.monotonic()) is None:
                raise Failure(f"hang: the socket stays open {TIMEOUT:.0f} s after session.close")

    def cut(self):
        """Drop the TCP connection without a close frame (the session parks)."""
        try:
            self.ws.transport.abort()
        except Exception:
            pass
        self.closed = ("cut", "by the client")

    async def drop(self):
        if not self.closed:
            try:
                await asyncio.wait_for(self.ws.close(), 5)
            except Exception:
                pass
            self.closed = self.closed or ("client", "closed by the client")


def summarize(msgs, limit=14):
    out = []
    audio = 0
    for m in msgs:
        if m[0] == "audio":
            audio += 1
            continue
        if audio:
            out.append(f"{audio}×audio")
            audio = 0
        if m[0] == "event":
            e = m[1]
            ty = e.get("type")
            if ty == "error":
                out.append(f"error({e.get('code')}, fatal={e.get('fatal')}, seq={e.get('seq')}: {short(str(e.get('message')), 90)})")
            elif ty == "response.done":
                out.append(f"response.done({e.get('status')}, {e.get('packets')} packets)")
            elif ty == "pong":
                out.append(f"pong(id={short(repr(e.get('id')), 40)})")
            elif ty == "session.closing":
                out.append(f"session.closing({e.get('reason')}, seq={e.get('seq')})")
            else:
                out.append(ty)
        elif m[0] == "closed":
            out.append(f"close({m[1][0]}, {short(str(m[1][1]), 60)})")
        else:
            out.append(f"non-JSON text {short(m[1], 60)}")
    if audio:
        out.append(f"{audio}×audio")
    if len(out) > limit:
        out = out[:limit - 2] + ["…"] + out[-1:]
    return "[" + ", ".join(out) + "]" if out else "[nothing]"


class Expect:
    """What the contract allows in answer to one case's input.

    codes:    documented error codes allowed (ANY: any documented one; empty: no error allowed)
    optional: an error is allowed but not required (the contract leaves it to the server)
    field:    names one of which a `bad_field` message must name
    close:    the close code required (with close_error sent before it)
    close_ok: close codes that are allowed (not required)
    response: 'forbid' | 'allow' | 'require' a response.created
    pong:     (id,) -- a pong with this id is required unless an error came instead
    create:   True / False / None -- whether session.created must / must not / may come
    """

    def __init__(self, codes=(), optional=False, field=None, close=None, close_error=None, close_ok=(),
                 response="forbid", pong=None, create=None, fatal_ok=False, note=""):
        self.codes = codes if codes == ANY else frozenset(codes)
        self.optional = optional
        self.field = (field,) if isinstance(field, str) else field
        self.close = close
        self.close_error = close_error
        self.close_ok = tuple(close_ok)
        self.response = response
        self.pong = pong
        self.create = create
        self.fatal_ok = fatal_ok
        self.note = note


def names_field(e, names):
    """The message (or a `field` member) names the field, or the field that contains it."""
    hay = str(e.get("message", "")) + " " + json.dumps(e.get("field", ""))
    wide = list(names)
    for n in names:
        par = PARENTS.get(n, ())
        wide += [par] if isinstance(par, str) else list(par)
    return any(n in hay for n in wide)


def evaluate(exp, conn, msgs):
    p = []
    errs = [m[1] for m in msgs if m[0] == "event" and m[1].get("type") == "error"]
    for e in errs:
        code = e.get("code")
        if code == "internal":
            p.append(f"`internal` error in answer to client input (a server fault, not a documented refusal): {e.get('message')!r}")
        elif exp.codes != ANY and code not in exp.codes:
            want = sorted(exp.codes) if exp.codes else "no error"
            p.append(f"error `{code}` ({e.get('message')!r}); the contract calls for {want}")
        if code in NEVER_FATAL and e.get("fatal") is not False and not exp.fatal_ok:
            p.append(f"`{code}` marked fatal={e.get('fatal')}; the contract says it is not fatal")
        if code == "bad_field" and exp.field and not names_field(e, exp.field):
            p.append(f"bad_field does not name the field {exp.field[0]!r}: {e.get('message')!r}")
    if exp.codes and not exp.optional and not errs:
        want = "an error" if exp.codes == ANY else f"error {'/'.join(sorted(exp.codes))}"
        p.append(f"no error; the contract calls for {want}")
    fatal = any(e.get("fatal") is True for e in errs)
    closed = conn.closed if conn.closed and conn.closed[0] != "cut" else None
    if exp.close:
        if not closed or closed[0] != exp.close:
            p.append(f"expected close {exp.close}, got {closed or 'the socket still open'}")
        if exp.close_error:
            before = [i for i, m in enumerate(msgs) if m[0] == "event" and m[1].get("type") == "error"
                      and m[1].get("code") == exp.close_error]
            if not before:
                p.append(f"no `{exp.close_error}` error before the close")
    elif closed:
        if closed[0] in exp.close_ok:
            pass
        elif not fatal:
            p.append(f"the server closed the socket {closed} without a fatal error")
    created = [m[1] for m in msgs if m[0] == "event" and m[1].get("type") == "response.created"]
    if exp.response == "forbid" and created:
        p.append(f"a response started ({len(created)}×response.created) for refused/inert input")
    if exp.response == "require" and not created and not fatal:
        p.append("no response.created; a valid request starts a response")
    if exp.pong is not None and not errs:
        pongs = [m[1] for m in msgs if m[0] == "event" and m[1].get("type") == "pong"]
        want = exp.pong[0]
        if not any(want is ANY_ID or pong.get("id", None) == want or isinstance(pong.get("id"), Raw) for pong in pongs):
            p.append(f"no pong with the same id {short(repr(want), 60)}; got {[short(repr(x.get('id')), 40) for x in pongs]}")
    if exp.create is True and not conn.in_session and not errs:
        p.append("no session.created for a valid session.create")
    if exp.create is False and conn.in_session:
        p.append("session.created for a session.create the contract refuses")
    return p


# ---------------------------------------------------------------------------------------------
# value catalogue and classification

ABSURD = [4294967296, 4294967295, 2 ** 53 + 1, 2 ** 63, 2 ** 64, 10 ** 40, -1, -2 ** 31, -4294967296,
          1e308, -1e308, 1.5, 0.5, -0.0, "NaN", "Infinity", "-inf", "nan", "", "1", "0x10", "１２",
          True, False, None, [], [1], {}, {"a": 1}, Raw("1e400"), Raw("-1e400"), Raw("NaN"),
          Raw("Infinity"), Raw("1" + "0" * 400), Raw("0x10"), Raw("01"), Raw("+1"), Raw(".5")]


def classify(kind, v):
    """'valid' | 'maybe' (left to the server) | 'invalid' (bad_field) | 'json' (not valid JSON)."""
    if isinstance(v, Raw):
        return "json"
    isbool = isinstance(v, bool)
    isint = isinstance(v, int) and not isbool
    isnum = isint or isinstance(v, float)
    integral = isint or (isinstance(v, float) and v == int(v) if isinstance(v, float) and abs(v) < 1e300 else False)
    if kind in ("count", "ms", "rid", "rid_opt", "ackseq", "inseq"):
        if v is None:  # null for an optional field may mean "absent"
            return "maybe" if kind in ("count", "rid_opt") else "invalid"
        if not isnum:
            return "invalid"
        if v < 0:
            return "invalid"
        if isint:
            return "maybe"
        return "maybe" if integral or v >= 1e300 else "invalid"
    if kind == "temperature":
        if v is None:
            return "maybe"
        if not isnum or v < 0:
            return "invalid"
        return "valid" if v <= 1 else "maybe"
    if kind == "seed":
        if v is None or isnum:
            return "maybe"
        return "invalid"
    if kind == "sample_rate":
        return "valid" if isint and v in (16000, 24000, 48000) else "invalid"
    if kind == "frame_ms":
        if v is None:
            return "maybe"
        return "valid" if isint and v in (10, 20, 40, 60) else "invalid"
    if kind == "k":
        if not isnum or v < 1:
            return "invalid"
        return "maybe"
    if kind == "codec":
        return "valid" if v in ("opus", "pcm16") else "invalid"
    if kind == "mode":
        return "valid" if v in ("turn", "duplex") else "invalid"
    if kind == "str":
        return "valid" if isinstance(v, str) else "invalid"
    if kind == "unknown":
        return "maybe"
    raise ValueError(kind)


def expect_for(cls, field, ok_response="forbid", ok_pong=None):
    if cls == "valid":
        return Expect(response=ok_response, pong=ok_pong)
    if cls == "maybe":
        return Expect({"bad_field"}, optional=True, field=field, response="allow" if ok_response != "forbid" else "forbid")
    if cls == "invalid":
        return Expect({"bad_field"}, field=field)
    return Expect({"bad_json", "bad_field"}, field=field)


def rand_text(rng, n):
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.?!'\"\\/{}[]\t\néßø中文字😀\u200b\u202e"
    return "".join(rng.choice(alphabet) for _ in range(n))


def rand_bytes(rng, n):
    return bytes(rng.getrandbits(8) for _ in range(n)) if n < 4096 else rng.randbytes(n)


# ---------------------------------------------------------------------------------------------
# cases

ROTATION = {}


def variant(cat, n):
    """A category's sub-variants in rotation, so that every one is covered whatever the seed; the
    values inside each variant are drawn from the case's seeded generator."""
    k = ROTATION.get(cat, 0)
    ROTATION[cat] = k + 1
    return k % n

class Case:
    def __init__(self, cat, desc, run, **kw):
        self.cat = cat
        self.desc = desc
        self.run = run
        self.__dict__.update(kw)


class Ctx:
    def __init__(self, url):
        self.url = url
        self.bystander = None
        self.outcomes = {}

    async def session(self, create=None, label="fuzz"):
        c = await Conn.open_(self.url, label)
        ev = create or CREATE
        await c.send(ev)
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = await c.recv_by(deadline, "session.created for a valid session.create")
            if m[0] == "closed" or (m[0] == "event" and m[1].get("type") == "error"):
                raise Failure(f"a valid session.create {short(dumps(ev), 160)} failed: {summarize(c.log)}")
            if m[0] == "event" and m[1].get("type") == "session.created":
                return c


def tally(ctx, case, msgs, conn):
    codes = [m[1].get("code") for m in msgs if m[0] == "event" and m[1].get("type") == "error"]
    key = ",".join(sorted(set(codes))) if codes else "no error"
    if conn.closed and conn.closed[0] not in ("cut", "client") and not conn.we_closed:
        key += f"+close {conn.closed[0]}"
    d = ctx.outcomes.setdefault(case.cat, {})
    d[key] = d.get(key, 0) + 1


async def finish(ctx, case, c, msgs, problems):
    """Common tail: report problems, check the session still works, close it (or clean it up)."""
    problems = problems + c.violations
    if problems:
        raise Failure("; ".join(problems) + f"\n      observed: {summarize(msgs)}")
    if c.closed:
        await cleanup(ctx, c)
        return
    if c.in_session:
        if c.mode == "turn":
            await c.request()
        else:
            await c.ping()
        await c.close_session()
    else:
        await c.drop()
    if c.violations:
        raise Failure("; ".join(c.violations))


async def cleanup(ctx, c):
    """A session whose socket the server closed may be parked: resume it and close it, so that
    parked sessions do not pile up against the server's capacity."""
    if not c.sid or c.reaped:
        return
    c.reaped = True
    r = await Conn.open_(ctx.url, "cleanup")
    r.resume_last = c.max_seq
    await r.send({"type": "session.resume", "session_id": c.sid, "resume_token": c.token, "last_seq": c.max_seq})
    deadline = time.monotonic() + TIMEOUT
    while True:
        m = await r.recv_by(deadline, "an answer to session.resume (cleanup)")
        if m[0] == "closed":
            return
        if m[0] == "event" and m[1].get("type") == "error":
            await r.drop()
            return
        if m[0] == "event" and m[1].get("type") == "session.resumed":
            break
    r.in_session = True
    await r.settle()
    await r.close_session()


async def run_in_session(ctx, case):
    c = await ctx.session(getattr(case, "create", None))
    try:
        setup = getattr(case, "setup", None)
        if setup:
            await setup(c)
        for item in case.sends:
            await c.send(item)
        msgs = await c.settle()
        tally(ctx, case, msgs, c)
        await finish(ctx, case, c, msgs, evaluate(case.expect, c, msgs))
    finally:
        await c.drop()


async def run_pre_session(ctx, case):
    c = await Conn.open_(ctx.url, "pre", getattr(case, "query", ""))
    try:
        for item in case.sends:
            await c.send(item)
        msgs = await c.settle()
        tally(ctx, case, msgs, c)
        problems = evaluate(case.expect, c, msgs)
        problems += c.violations
        if problems:
            raise Failure("; ".join(problems) + f"\n      observed: {summarize(msgs)}")
        if c.closed:
            await cleanup(ctx, c)
            return
        if not c.in_session:
            # nothing fatal happened: the socket must still take a valid session.create
            errs = [m[1] for m in msgs if m[0] == "event" and m[1].get("type") == "error"]
            await c.send(CREATE)
            deadline = time.monotonic() + TIMEOUT
            while True:
                m = await c.recv_by(deadline, "session.created after a non-fatal pre-session error")
                if m[0] == "closed" or (m[0] == "event" and m[1].get("type") == "error"):
                    raise Failure(f"after non-fatal {[e.get('code') for e in errs]}, a valid session.create on the "
                                  f"same socket failed: {summarize(c.log[-4:])}")
                if m[0] == "event" and m[1].get("type") == "session.created":
                    break
        await finish(ctx, case, c, [], [])
    finally:
        await c.drop()


def in_case(cat, sends, expect, create=None, setup=None, note=""):
    sends = sends if isinstance(sends, list) else [sends]
    desc = " + ".join(describe(s) for s in sends)
    if create:
        desc = f"[session {short(dumps(create), 120)}] " + desc
    if note:
        desc = f"({note}) " + desc
    return Case(cat, desc, run_in_session, sends=sends, expect=expect, create=create, setup=setup)


def pre_case(cat, sends, expect, query="", note=""):
    sends = sends if isinstance(sends, list) else [sends]
    desc = "[no session] " + (f"url{query} " if query else "") + " + ".join(describe(s) for s in sends)
    if note:
        desc = f"({note}) " + desc
    return Case(cat, desc, run_pre_session, sends=sends, expect=expect, query=query)


async def send_pcm(c, ms=200, rate=16000, seq=None):
    n = rate * ms // 1000
    await c.send(frame(1, seq or 0, b"\x00\x00" * n))


# --- invalid JSON --------------------------------------------------------------------------------

def g_invalid_json(rng):
    good = dumps({"type": "ping", "id": 1})
    bad = [
        "{broken", "{", "}", "", " ", "\n\t", "{\"type\":\"ping\"", "{\"type\":\"ping\",}", "{\"type\":ping}",
        "{'type':'ping'}", "{\"type\":\"ping\"}x", good + good, good + ",", "NaN", "Infinity", "undefined",
        "{\"type\":\"ping\",\"id\":NaN}", "{\"type\":\"ping\",\"id\":Infinity}", "{\"type\":\"ping\",\"id\":0x10}",
        "{\"type\":\"ping\",\"id\":01}", "{\"type\":\"ping\",\"id\":+1}", "{\"type\":\"ping\",\"id\":.5}",
        "{\"type\":\"ping\" \"id\":1}", "{\"type\":\"ping\",\"id\":\"\\x41\"}", "{\"type\":\"ping\",\"id\":\"\\u12\"}",
        "{\"type\":\"ping\",\"id\":\"a\nb\"}", "{\"type\":\"ping\",/*c*/\"id\":1}", "{\"type\":\"ping\"}//",
        "{\"type\":\"ping\",\"id\":\"" + "x" * 1000, "[" * 50, "{\"a\":" * 50, "\"unterminated", "tru", "nul",
        "{\"type\":\"input.text\",\"text\":\"hi\"", "\ufeff" + good, "{\"type\":\"ping\",\"id\":1e}",
        "{\"type\":\"ping\",\"id\":-}", "{\"type\":\"ping\",\"id\":[1,]}", "{\"type\":\"ping\",\"id\":\"\\ud800\\u\"}",
    ]
    s = rng.choice(bad)
    if rng.random() < 0.25:
        # random corruption of a valid event: truncation
        src = dumps({"type": "input.text", "text": rand_text(rng, 20), "generation": TINY})
        s = src[:rng.randrange(1, len(src) - 1)]
    return in_case("invalid_json", s, Expect({"bad_json"}))


# --- JSON that is not an object --------------------------------------------------------------------

def g_non_object(rng):
    vals = ["[]", "[{\"type\":\"ping\"}]", "\"ping\"", "42", "null", "true", "false", "1e308", "-0", "\"\"",
            "\"\\u0000\"", "[[[]]]", "{\"type\":\"ping\"}".join(["[", "]"]), "0.5", "-1", "\"{\\\"type\\\":\\\"ping\\\"}\""]
    return in_case("non_object", rng.choice(vals), Expect({"bad_json", "bad_field", "unknown_event"}))


# --- unknown / malformed event types -------------------------------------------------------------

SERVER_TYPES = ["session.created", "session.resumed", "response.created", "response.text.delta", "response.done",
                "duplex.listen", "duplex.speak", "pong", "session.closing", "error"]
CLIENT_TYPES = ["session.create", "session.resume", "session.update", "input.text", "input.commit", "input.clear",
                "response.cancel", "playback", "ack", "ping", "session.close"]


def g_event_type(rng):
    r = rng.random()
    if r < 0.55:
        t = rng.choice(SERVER_TYPES + ["teleport", "", " ", "PING", "Ping", "input.TEXT", "input.text ", " input.text",
                                       "input_text", "input", "session", "session.", ".close", "ping\u0000",
                                       "response.create", "conversation.item.create", "input_audio_buffer.append",
                                       "input.audio", "audio", "🙂", "\u202eping", rand_text(rng, rng.randrange(1, 40)),
                                       "x" * rng.choice([1000, 100000])])
        ev = {"type": t}
        if rng.random() < 0.5:
            ev["text"] = "hi"
        return in_case("event_type", ev, Expect({"unknown_event"}))
    if r < 0.8:
        v = rng.choice([1, 0, -1, 1.5, None, True, [], ["ping"], {}, {"type": "ping"}, 4294967296])
        return in_case("event_type", {"type": v, "id": 1},
                       Expect({"bad_field", "unknown_event", "bad_json"}, field="type"))
    ev = rng.choice([{}, {"text": "hi"}, {"Type": "ping"}, {"TYPE": "ping"}, {"type ": "ping"}, {"id": 1}])
    return in_case("event_type", ev, Expect({"bad_field", "unknown_event", "bad_json"}, field="type"))


# --- known events with missing / wrong-typed / extra fields --------------------------------------

def wrong(rng, exclude_str=False):
    vals = [1, -1, 1.5, None, True, [], ["x"], {}, {"a": 1}, 4294967296]
    if not exclude_str:
        vals += ["", "x"]
    return rng.choice(vals)


def g_fields(rng):
    r = variant('fields', 12)
    if r == 0:  # input.text without text
        ev = rng.choice([{"type": "input.text"}, {"type": "input.text", "generation": TINY},
                         {"type": "input.text", "txt": "hi"}, {"type": "input.text", "Text": "hi"}])
        return in_case("fields", ev, Expect({"bad_field"}, field="text"))
    if r == 1:  # input.text text wrong type
        return in_case("fields", {"type": "input.text", "text": wrong(rng, True), "generation": TINY},
                       Expect({"bad_field"}, field="text"))
    if r == 2:  # playback missing fields
        ev = rng.choice([({"type": "playback", "response_id": 1}, "played_ms"),
                         ({"type": "playback", "played_ms": 10}, "response_id"),
                         ({"type": "playback"}, ("response_id", "played_ms"))])
        return in_case("fields", ev[0], Expect({"bad_field"}, field=ev[1]))
    if r == 3:  # ack missing seq / wrong type
        if rng.random() < 0.4:
            return in_case("fields", {"type": "ack"}, Expect({"bad_field"}, field="seq"))
        v = rng.choice(["1", "", None, True, [], {}, 1.5, -1, -4294967296])
        return in_case("fields", {"type": "ack", "seq": v}, Expect({"bad_field"}, field="seq"))
    if r == 4:  # ping ids of every type: echoed back
        v = rng.choice([0, -1, 2 ** 53 + 1, 2 ** 64, 1.5, 1e308, "", "x" * 5000, None, True, [], [1, [2, [3]]],
                        {"a": {"b": [1, None]}}, "\u0000\u202e😀", {"type": "pong"}])
        return in_case("fields", {"type": "ping", "id": v},
                       Expect({"bad_field"}, optional=True, field="id", pong=(v,)))
    if r == 5:  # response.cancel with a wrong-typed response_id
        v = rng.choice(["1", "", True, False, [], [1], {}, {"a": 1}, 1.5, -1, -4294967296])
        return in_case("fields", {"type": "response.cancel", "response_id": v}, Expect({"bad_field"}, field="response_id"))
    if r == 6:  # extra fields on events that take none: left to the server, but no crash, no response
        ev = rng.choice([{"type": "input.clear", "junk": wrong(rng)}, {"type": "ping", "id": 3, "extra": [1, 2]},
                         {"type": "response.cancel", "why": "x"}, {"type": "ack", "seq": 0, "more": {}}])
        return in_case("fields", ev, Expect({"bad_field"}, optional=True, field=[k for k in ev if k not in ("type",)]))
    if r == 7:  # input.text with extra fields: the response may run
        ev = {"type": "input.text", "text": "hi", "generation": dict(TINY), rng.choice(["voice", "foo", "mode", "x" * 300]): wrong(rng)}
        return in_case("fields", ev, Expect({"bad_field"}, optional=True, response="allow"))
    if r == 8:  # session.update with wrong-typed fields
        f = rng.choice(["input_audio", "output_audio", "voice", "instructions", "generation"])
        v = wrong(rng, exclude_str=f != "instructions")
        if f == "instructions" and isinstance(v, str):
            v = 5
        # null, or an object (a partial / empty / unknown-keyed one): the server's call; any other type: bad_field
        ex = Expect({"bad_field"}, optional=v is None or isinstance(v, dict), field=f)
        return in_case("fields", {"type": "session.update", f: v}, ex)
    if r == 9:  # session.update changing the mode: "any subset ... except mode"
        return in_case("fields", {"type": "session.update", "mode": "duplex"}, Expect({"bad_field"}, field="mode"))
    if r == 10:  # session.update with nested wrong fields
        f, sub, v = rng.choice([("input_audio", "codec", "mp3"), ("input_audio", "codec", 1),
                                ("output_audio", "codec", "wav"), ("output_audio", "frame_ms", 15),
                                ("voice", "id", "no-such-voice-" + str(rng.randrange(10 ** 6))), ("voice", "id", 7),
                                ("input_audio", "sample_rate", 44100), ("voice", "ref_audio_b64", "!!!not base64!!!")])
        ev = {"type": "session.update", f: {sub: v}}
        if f == "input_audio" and sub == "codec":
            ev[f]["sample_rate"] = 16000
        if f == "input_audio" and sub == "sample_rate":
            ev[f]["codec"] = "pcm16"
        if sub == "ref_audio_b64":
            ev[f]["sample_rate"] = 16000
        return in_case("fields", ev, Expect({"bad_field"}, field=(sub, f)))
    # seq of wrong type on input events
    v = rng.choice(["1", None, True, [], {}, 1.5, -1, -4294967296])
    ev = rng.choice([{"type": "input.text", "text": "hi", "generation": TINY, "seq": v},
                     {"type": "input.clear", "seq": v}])
    return in_case("fields", ev, Expect({"bad_field"}, field="seq"))


# --- absurd values in every numeric / enumerated field --------------------------------------------

GEN_FIELDS = [("max_text_tokens", "count"), ("min_text_tokens", "count"), ("max_audio_tokens", "count"),
              ("min_audio_tokens", "count"), ("temperature", "temperature"), ("seed", "seed"),
              ("top_p", "unknown")]  # top_p is not in the contract's generation object: ignored or refused


def g_absurd(rng):
    v = rng.choice(ABSURD + [2.0, 1.0, 0.0, 0, 1, 64])
    where = variant('absurd', 7)
    if where <= 2:
        name, kind = rng.choice(GEN_FIELDS)
        cls = classify(kind, v)
        if where == 0:  # session.update
            return in_case("absurd_values", {"type": "session.update", "generation": {name: v}}, expect_for(cls, name))
        gen = dict(TINY)
        gen[name] = v
        if where == 1:
            return in_case("absurd_values", {"type": "input.text", "text": "hi", "generation": gen},
                           expect_for(cls, name, "require"))
        return in_case("absurd_values", {"type": "input.commit", "generation": gen}, expect_for(cls, name, "require"),
                       setup=send_pcm, note="after 200 ms of PCM")
    if where == 3:  # playback
        f = rng.choice(["response_id", "played_ms"])
        ev = {"type": "playback", "response_id": 1, "played_ms": 0}
        ev[f] = v
        return in_case("absurd_values", ev, expect_for(classify("rid" if f == "response_id" else "ms", v), f),
                       setup=lambda c: c.request(), note="after one response")
    if where == 4:  # ack
        return in_case("absurd_values", {"type": "ack", "seq": v}, expect_for(classify("ackseq", v), "seq"))
    if where == 5:  # response.cancel
        return in_case("absurd_values", {"type": "response.cancel", "response_id": v},
                       expect_for(classify("rid_opt", v), "response_id"))
    # session.update audio formats
    f, sub, kind = rng.choice([("input_audio", "sample_rate", "sample_rate"), ("output_audio", "frame_ms", "frame_ms"),
                               ("input_audio", "codec", "codec"), ("output_audio", "codec", "codec")])
    obj = {"codec": "pcm16", "sample_rate": 16000} if f == "input_audio" else {"codec": "pcm16", "frame_ms": 20}
    obj[sub] = v
    return in_case("absurd_values", {"type": "session.update", f: obj}, expect_for(classify(kind, v), sub))


# --- session.create fuzz (before any session) ------------------------------------------------------

def g_create(rng):
    ev = create_event(codec=rng.choice(["pcm16", "opus"]), rate=rng.choice([16000, 24000, 48000]),
                      out=rng.choice(["pcm16", "opus"]))
    r = variant('create', 8)
    v = rng.choice(ABSURD + ["turn", "duplex", "opus", "pcm16", 16000, 48000, 10, 60])
    if r == 0:
        name, kind = rng.choice(GEN_FIELDS)
        ev["generation"] = {name: v}
        cls, field = classify(kind, v), name
    elif r == 1:
        sub, kind = rng.choice([("codec", "codec"), ("sample_rate", "sample_rate")])
        ev["input_audio"][sub] = v
        cls, field = classify(kind, v), sub
    elif r == 2:
        sub, kind = rng.choice([("codec", "codec"), ("frame_ms", "frame_ms")])
        ev["output_audio"][sub] = v
        cls, field = classify(kind, v), sub
    elif r == 3:
        ev["mode"] = v
        cls, field = classify("mode", v), "mode"
        if ev["mode"] == "duplex":
            ev["duplex"] = {"policy": "speak_every", "k": 2}
    elif r == 4:
        ev["mode"] = "duplex"
        if rng.random() < 0.5:
            ev["duplex"] = {"policy": "speak_every", "k": v}
            cls, field = classify("k", v), "k"
        else:
            ev["duplex"] = {"policy": rng.choice(["always", "", "Model", 1, [], "speak_every"])}
            cls, field = "invalid", ("policy", "k")
    elif r == 5:  # missing required fields
        f = rng.choice(["mode", "input_audio", "output_audio"])
        del ev[f]
        if f != "mode" and rng.random() < 0.5:
            ev[f] = {}
        cls, field = "invalid", f
        if f == "input_audio" and rng.random() < 0.5:
            ev[f] = {"codec": "pcm16"}
            field = "sample_rate"
    elif r == 6:  # voices
        ev["voice"] = rng.choice([{"id": "no-such-voice"}, {"id": ""}, {"id": 3}, {}, "default", [],
                                  {"ref_audio_b64": "@@@@", "sample_rate": 16000},
                                  {"ref_audio_b64": "AAAA", "sample_rate": -5},
                                  {"ref_audio_b64": "", "sample_rate": 16000},
                                  {"ref_audio_b64": "UklGRiQAAABXQVZF", "sample_rate": 16000},
                                  {"sample_rate": 16000}])
        cls, field = "invalid", ("voice", "id", "ref_audio_b64", "sample_rate")
    else:  # top-level wrong types and extras
        f = rng.choice(["input_audio", "output_audio", "instructions", "generation", "duplex", "voice", "extra"])
        ev[f] = v = wrong(rng, exclude_str=f != "instructions")
        if f == "instructions" and isinstance(v, str):
            ev[f] = v = 0
        if f in ("extra", "duplex"):  # unknown keys / a duplex block in turn mode: the server's call
            cls = "maybe"
        elif f == "generation":
            cls = "maybe" if v is None or isinstance(v, dict) else "invalid"
        elif f in ("instructions", "voice"):
            cls = "maybe" if v is None else "invalid"
        else:
            cls = "invalid"
        field = f
    ex = expect_for(cls, field)
    ex.create = {"valid": True, "maybe": None}.get(cls, False)
    ex.response = "forbid"
    return pre_case("create", ev, ex)


# --- huge generation counts where the contract allows them ----------------------------------------

def g_generation(rng):
    # past any sane limit (refused, or accepted and then cut short by response.cancel), or merely long
    big = rng.choice([4294967296, 2 ** 32 - 1, 2 ** 31, 10 ** 9, 10 ** 6, 100000, 4096, 2 ** 64, 10 ** 30, 1000, 2000])
    fields = rng.sample(["max_text_tokens", "min_text_tokens", "max_audio_tokens", "min_audio_tokens"], rng.randrange(1, 5))
    gen = {f: big for f in fields}
    if rng.random() < 0.3:
        gen["temperature"] = rng.choice([0.0, 0.7, 1.0])
    where = variant('generation', 4)
    ex = Expect({"bad_field"}, optional=True, field=fields, response="allow")
    if where == 0:
        ev = create_event(generation=gen)
        ex.response = "forbid"
        return pre_case("generation_huge", ev, ex)
    if where == 1:
        return in_case("generation_huge", [{"type": "session.update", "generation": gen},
                                           {"type": "input.text", "text": "go", "generation": {}}], ex)
    if where == 2:
        return in_case("generation_huge", {"type": "input.text", "text": "a long one", "generation": gen}, ex)
    return in_case("generation_huge", {"type": "input.commit", "generation": gen}, ex, setup=send_pcm,
                   note="after 200 ms of PCM")


# --- long strings --------------------------------------------------------------------------------

def g_long(rng):
    r = variant('long', 6)
    n = rng.choice([8192, 8193, 20000, 100000, 200000, 250000])
    if r == 0:  # a very long user text
        words = "the quick brown fox jumps over a lazy dog "
        ev = {"type": "input.text", "text": (words * (n // len(words) + 1))[:n], "generation": TINY}
        return in_case("long_strings", ev, Expect({"bad_field"}, optional=True, field="text", response="allow"))
    if r == 1:  # oversized instructions in session.create: refused, or the session works
        ev = create_event(instructions="You are helpful. " * (n // 17))
        return pre_case("long_strings", ev, Expect({"bad_field"}, optional=True, field="instructions"))
    if r == 2:
        ev = {"type": "session.update", "instructions": "i" * n}
        return in_case("long_strings", ev, Expect({"bad_field"}, optional=True, field="instructions"))
    if r == 3:  # a long voice id
        return in_case("long_strings", {"type": "session.update", "voice": {"id": "v" * n}},
                       Expect({"bad_field"}, field=("voice", "id")))
    if r == 4:  # a huge key
        return in_case("long_strings", {"type": "ping", "id": 9, "k" * n: 1},
                       Expect({"bad_field"}, optional=True, pong=(9,)))
    # exotic but valid text: must work
    text = rng.choice(["😀" * 50, "\u202eabc\u202c", "a\u0301" * 30, "\u0000", "\t\n\r", "中文字" * 20, "\uffff",
                       "\\u0000", "'; DROP TABLE users; --", "<script>alert(1)</script>", "%s%n%x", "\U0010FFFF"])
    if rng.random() < 0.3:
        return in_case("long_strings", dumps({"type": "input.text", "text": "x", "generation": TINY}).replace(
            '"x"', rng.choice(['"\\ud800"', '"\\udfff"', '"\\ud800\\ud800"', '"a\\udc00b"'])),
            Expect({"bad_json", "bad_field"}, optional=True, field="text", response="allow"), note="lone surrogate")
    if text.strip() in ("", "\u0000"):  # nothing to say: refused or answered, the server's call
        return in_case("long_strings", {"type": "input.text", "text": text, "generation": TINY},
                       Expect({"bad_field"}, optional=True, field="text", response="allow"))
    return in_case("long_strings", {"type": "input.text", "text": text, "generation": TINY}, Expect(response="require"))


# --- deep nesting --------------------------------------------------------------------------------

def nested(rng, d):
    """(text, is_array)"""
    if rng.random() < 0.6:
        return "[" * d + "]" * d, True
    return "{\"a\":" * d + "1" + "}" * d, False


def g_nesting(rng):
    d = rng.choice([32, 127, 128, 129, 200, 1000, 10000, 50000, 100000])
    r = variant('nesting', 5)
    text, is_array = nested(rng, d)
    if len(text) > TEXT_LIMIT - 200:  # stay under the frame limit: this category is about depth
        d = (TEXT_LIMIT - 200) // (len(text) // d)
        text, is_array = ("[" * d + "]" * d, True) if is_array else ("{\"a\":" * d + "1" + "}" * d, False)
    if r == 0:  # an id of any shape is echoed, or refused
        return in_case("nesting", {"type": "ping", "id": Raw(text)},
                       Expect({"bad_json", "bad_field"}, optional=True, pong=(ANY_ID,)), note=f"depth {d}")
    if r == 1:
        return in_case("nesting", {"type": "ping", "id": 5, "junk": Raw(text)},
                       Expect({"bad_json", "bad_field"}, optional=True, pong=(5,)), note=f"depth {d}")
    if r == 2:
        return in_case("nesting", {"type": "input.text", "text": Raw(text), "generation": TINY},
                       Expect({"bad_json", "bad_field"}, field="text"), note=f"depth {d}")
    if r == 3:  # arrays are not a generation object; nested unknown keys may be ignored
        return in_case("nesting", {"type": "session.update", "generation": Raw(text)},
                       Expect({"bad_json", "bad_field"}, optional=not is_array, field="generation"), note=f"depth {d}")
    return in_case("nesting", text, Expect({"bad_json", "bad_field", "unknown_event"}), note=f"top level, depth {d}")


# --- acks ----------------------------------------------------------------------------------------

def g_ack(rng):
    r = variant('ack', 5)
    if r == 0:  # ahead of anything sent
        v = rng.choice([2, 3, 100, 4294967295, 4294967296, 2 ** 63])
        return in_case("ack", {"type": "ack", "seq": v}, Expect({"bad_field"}, optional=True, field="seq"),
                       note="ack ahead of what was sent")
    if r == 1:  # exactly what was received: valid
        return Case("ack", "ack of the highest seq received, 50 times", run_ack_exact)
    if r == 2:
        return in_case("ack", {"type": "ack", "seq": 0}, Expect({"bad_field"}, optional=True, field="seq"))
    if r == 3:  # a storm of acks, valid and not
        sends = [{"type": "ack", "seq": rng.choice([0, 1])} for _ in range(100)]
        return in_case("ack", sends, Expect())
    return in_case("ack", {"type": "ack", "seq": rng.choice([-1, "1", 1.5, None, [], {}])},
                   Expect({"bad_field"}, field="seq"))


async def run_ack_exact(ctx, case):
    c = await ctx.session()
    try:
        await c.request()
        for _ in range(50):
            await c.send({"type": "ack", "seq": c.max_seq})
        msgs = await c.settle()
        tally(ctx, case, msgs, c)
        await finish(ctx, case, c, msgs, evaluate(Expect(), c, msgs))
    finally:
        await c.drop()


# --- resume ----------------------------------------------------------------------------------------

async def parked_session(ctx, requests=1):
    c = await ctx.session(label="to-park")
    for _ in range(requests):
        await c.request(ack=False)
    c.cut()
    await asyncio.sleep(0.15)
    return c


async def expect_resume_answer(ctx, sid, tok, last, exp, query="", label="resume", extra=None):
    r = await Conn.open_(ctx.url, label, query)
    r.resume_last = last if isinstance(last, int) and not isinstance(last, bool) else 0
    ev = {"type": "session.resume", "session_id": sid, "resume_token": tok, "last_seq": last}
    for k in [k for k, v in ev.items() if v is MISSING]:
        del ev[k]
    if extra:
        ev.update(extra)
    await r.send(ev)
    msgs = await r.settle()
    return r, msgs, ev


MISSING = object()


async def resume_and_close(ctx, sid, tok, last, owner=None):
    if owner is not None:
        owner.reaped = True
    r = await Conn.open_(ctx.url, "resume-close")
    r.resume_last = last
    await r.send({"type": "session.resume", "session_id": sid, "resume_token": tok, "last_seq": last})
    deadline = time.monotonic() + TIMEOUT
    while True:
        m = await r.recv_by(deadline, "session.resumed")
        if m[0] == "closed" or (m[0] == "event" and m[1].get("type") == "error"):
            raise Failure(f"a right resume of a parked session failed: {summarize(r.log)}")
        if m[0] == "event" and m[1].get("type") == "session.resumed":
            break
    msgs = await r.settle()
    if r.violations:
        raise Failure("; ".join(r.violations) + f"; observed {summarize(msgs)}")
    await r.request()
    await r.close_session()
    if r.violations:
        raise Failure("; ".join(r.violations))


def g_resume(rng):
    r = variant('resume', 10)
    if r == 0:  # missing fields
        f = rng.choice(["session_id", "resume_token", "last_seq"])
        return Case("resume", f"session.resume of a parked session without `{f}`", run_resume_variant,
                    variant="missing", field=f, rng=random.Random(rng.random()))
    if r == 1:  # wrong types
        f = rng.choice(["session_id", "resume_token", "last_seq"])
        v = wrong(rng, exclude_str=True) if f != "last_seq" else rng.choice(["1", -1, 1.5, None, [], {}, True])
        return Case("resume", f"session.resume of a parked session with `{f}`={v!r}", run_resume_variant,
                    variant="type", field=f, value=v, rng=random.Random(rng.random()))
    if r == 2:  # unknown ids
        sid = rng.choice(["", "x", "s_" + "A" * 16, "../../etc/passwd", "\u0000", "s_" + "z" * 5000, "😀", "null"])
        ev = {"type": "session.resume", "session_id": sid, "resume_token": rand_text(rng, 10), "last_seq": 0}
        return pre_case("resume", ev, Expect({"session_not_found", "bad_field"}, field="session_id"))
    if r == 3:
        v = rng.choice(["", "wrong", "x" * 10000, "\u0000"])
        return Case("resume", f"session.resume of a parked session with a wrong token {short(repr(v), 40)}",
                    run_resume_variant, variant="token", value=v, rng=random.Random(rng.random()))
    if r == 4:
        return Case("resume", "session.resume with a wrong token for the live bystander session", run_resume_hijack)
    if r == 5:
        return Case("resume", "session.resume with the right token for a live session (takeover)", run_resume_takeover)
    if r == 6:
        return Case("resume", "session.resume of a session ended with session.close", run_resume_closed)
    if r == 7:
        v = rng.choice(["s_" + "B" * 16, "zzz", "other"])
        return Case("resume", f"session.resume of a parked session from url ?session_id={v} (a mismatch)",
                    run_resume_variant, variant="url", value=v, rng=random.Random(rng.random()))
    if r == 8:
        return Case("resume", "session.resume with last_seq in 0..max, no acks: replay of exactly what is missing",
                    run_resume_variant, variant="replay", rng=random.Random(rng.random()))
    return Case("resume", "session.resume as the second event of a live session", run_resume_inside)


async def run_resume_variant(ctx, case):
    p = await parked_session(ctx)
    sid, tok, last = p.sid, p.token, p.max_seq
    v = case.variant
    query = ""
    extra = None
    if v == "missing":
        args = {"session_id": sid, "resume_token": tok, "last_seq": last}
        args[case.field] = MISSING
        exp = Expect({"bad_field"}, field=case.field)
    elif v == "type":
        args = {"session_id": sid, "resume_token": tok, "last_seq": last}
        args[case.field] = case.value
        exp = Expect({"bad_field", "bad_resume_token"} if case.field == "resume_token" else {"bad_field"}, field=case.field)
    elif v == "token":
        args = {"session_id": sid, "resume_token": case.value, "last_seq": last}
        exp = Expect({"bad_resume_token"})
    elif v == "url":
        args = {"session_id": sid, "resume_token": tok, "last_seq": last}
        query = f"?session_id={case.value}"
        exp = Expect({"bad_field"}, field="session_id")
    else:  # replay
        args = {"session_id": sid, "resume_token": tok, "last_seq": case.rng.randrange(0, last + 1)}
        exp = Expect(response="allow")  # the replay may hold a response.created
    r, msgs, ev = await expect_resume_answer(ctx, args["session_id"], args["resume_token"], args["last_seq"], exp,
                                             query=query, extra=extra)
    case.desc += f": {short(dumps(ev), 160)}"
    try:
        tally(ctx, case, msgs, r)
        problems = evaluate(exp, r, msgs) + r.violations
        resumed = [m for m in msgs if m[0] == "event" and m[1].get("type") == "session.resumed"]
        if v == "replay":
            got = [m[1].get("seq") if m[0] == "event" else m[1]["seq"] for m in msgs
                   if (m[0] == "audio" and m[1].get("kind") == 1) or (m[0] == "event" and "seq" in m[1])]
            want = list(range(args["last_seq"] + 1, last + 1))
            if not resumed:
                problems.append("no session.resumed for a right resume")
            elif got[:len(want)] != want:
                problems.append(f"replay after last_seq {args['last_seq']}: seqs {got[:12]}…, expected {want[:12]}…")
        elif resumed:
            problems.append("the session was resumed although the contract refuses this resume")
        if problems:
            raise Failure("; ".join(problems) + f"\n      observed: {summarize(msgs)}")
        if resumed:
            p.reaped = True
            await r.request()
            await r.close_session()
            return
        await r.drop()
        # the refused attempt must not have harmed the parked session
        await resume_and_close(ctx, sid, tok, last, p)
    finally:
        await r.drop()


async def run_resume_hijack(ctx, case):
    b = ctx.bystander
    r, msgs, ev = await expect_resume_answer(ctx, b.sid, "not-" + str(b.token), b.max_seq, None)
    try:
        tally(ctx, case, msgs, r)
        problems = evaluate(Expect({"bad_resume_token", "session_in_use"}), r, msgs) + r.violations
        if any(m[0] == "event" and m[1].get("type") == "session.resumed" for m in msgs):
            problems.append("a wrong token took over a live session")
        if problems:
            raise Failure("; ".join(problems) + f"\n      observed: {summarize(msgs)}")
    finally:
        await r.drop()
    await check_bystander(ctx)


async def run_resume_takeover(ctx, case):
    a = await ctx.session(label="older")
    try:
        await a.request()
        r, msgs, ev = await expect_resume_answer(ctx, a.sid, a.token, a.max_seq, None, label="newer")
        a.reaped = True  # the session is the newer socket's now
        tally(ctx, case, msgs, r)
        problems = r.violations[:]
        if not any(m[0] == "event" and m[1].get("type") == "session.resumed" for m in msgs):
            problems.append(f"the right token did not win the attach: {summarize(msgs)}")
        deadline = time.monotonic() + TIMEOUT
        while not a.closed:
            if await a.recv(deadline - time.monotonic()) is None:
                problems.append("the older socket stays open after the takeover")
                break
        closing = [m[1] for m in a.log if m[0] == "event" and m[1].get("type") == "session.closing"]
        if not closing or closing[-1].get("reason") != "replaced":
            problems.append(f"the older socket got no session.closing `replaced`: {summarize(a.log[-4:])}")
        problems += a.violations
        if problems:
            raise Failure("; ".join(problems))
        await r.request()
        await r.close_session()
        if r.violations:
            raise Failure("; ".join(r.violations))
    finally:
        await a.drop()


async def run_resume_closed(ctx, case):
    c = await ctx.session()
    await c.request()
    sid, tok, last = c.sid, c.token, c.max_seq
    await c.close_session()
    r, msgs, ev = await expect_resume_answer(ctx, sid, tok, last, None)
    try:
        tally(ctx, case, msgs, r)
        problems = evaluate(Expect({"session_not_found", "session_expired"}), r, msgs) + r.violations
        if problems:
            raise Failure("; ".join(problems) + f"\n      observed: {summarize(msgs)}")
    finally:
        await r.drop()


async def run_resume_inside(ctx, case):
    other = await parked_session(ctx)
    c = await ctx.session()
    try:
        await c.send({"type": "session.resume", "session_id": other.sid, "resume_token": other.token,
                      "last_seq": other.max_seq})
        msgs = await c.settle()
        tally(ctx, case, msgs, c)
        problems = evaluate(Expect(ANY), c, msgs)
        await finish(ctx, case, c, msgs, problems)
    finally:
        await c.drop()
    await resume_and_close(ctx, other.sid, other.token, other.max_seq, other)


# --- before any session ----------------------------------------------------------------------------

def g_pre(rng):
    r = variant('pre', 6)
    if r == 0:
        ev = rng.choice([{"type": "input.text", "text": "hi"}, {"type": "input.commit"}, {"type": "input.clear"},
                         {"type": "response.cancel"}, {"type": "playback", "response_id": 1, "played_ms": 5},
                         {"type": "ack", "seq": 1}, {"type": "session.update", "instructions": "x"}])
        return pre_case("pre_session", ev, Expect({"not_in_session"}))
    if r == 1:
        return pre_case("pre_session", rng.choice(["{broken", "[]", "", "null", "{\"type\":"]),
                        Expect({"bad_json", "not_in_session"}))
    if r == 2:
        return pre_case("pre_session", {"type": rng.choice(["teleport", "PING", ""])},
                        Expect({"unknown_event", "not_in_session"}))
    if r == 3:
        b = rng.choice([b"", b"\x01", frame(1, 1, b"\x00" * 640), frame(7, 0, b"zz"), rand_bytes(rng, rng.randrange(1, 2000))])
        return pre_case("pre_session", b, Expect({"not_in_session", "bad_audio"}, optional=b[:1] not in (b"\x01",)
                                                 and len(b) >= 12))
    if r == 4:
        return pre_case("pre_session", {"type": "ping", "id": "pre"},
                        Expect({"not_in_session"}, optional=True, pong=("pre",)))
    return pre_case("pre_session", {"type": "session.close"}, Expect({"not_in_session"}, optional=True, close_ok=(1000,)))


# --- binary frames ---------------------------------------------------------------------------------

OPUS_DUR = [10, 20, 40, 60] * 3 + [10, 20] * 2 + [2.5, 5, 10, 20] * 4  # frame ms per TOC config 0..31


def bad_opus(rng):
    """A packet that RFC 6716 section 3.4 forbids (receivers MUST NOT process it)."""
    cfg, s = rng.randrange(32), rng.randrange(2)

    def toc(code):
        return bytes([(cfg << 3) | (s << 2) | code])
    r = rng.randrange(7)
    if r == 0:  # [R3] code 1: two equal frames need an even payload
        return toc(1) + rand_bytes(rng, 2 * rng.randrange(0, 40) + 1), "code 1, odd payload"
    if r == 1:  # [R4] code 2: the first frame's length exceeds the packet
        ln = rng.randrange(2, 250)
        return toc(2) + bytes([ln]) + rand_bytes(rng, rng.randrange(0, ln - 1)), "code 2, frame length past the end"
    if r == 2:  # [R5] code 3 with M = 0
        return toc(3) + bytes([rng.choice([0x00, 0x80])]) + rand_bytes(rng, 10), "code 3, M=0"
    if r == 3:  # [R5] code 3, more than 120 ms
        m = rng.randrange(int(120 // OPUS_DUR[cfg]) + 1, 64)
        return toc(3) + bytes([m]) + rand_bytes(rng, 2 * m), f"code 3, M={m} frames of {OPUS_DUR[cfg]} ms"
    if r == 4:  # [R2] a frame over 1275 bytes
        return toc(0) + rand_bytes(rng, rng.randrange(1276, 1500)), "code 0, frame > 1275 bytes"
    if r == 5:  # [R6/R7] padding longer than the packet
        return toc(3) + bytes([0x40 | 1, 254]) + rand_bytes(rng, 5), "code 3, padding past the end"
    return bytes([0xFF] * 40), "code 3, 63 frames"


def g_binary(rng):
    r = variant('binary', 10)
    opus = create_event(codec="opus", rate=rng.choice([16000, 24000, 48000]))
    if r == 0:  # shorter than the header
        n = rng.randrange(0, 12)
        return in_case("binary", bytes([1]) + rand_bytes(rng, n)[1:] if n else b"", Expect({"bad_audio"}),
                       note=f"{n}-byte frame")
    if r == 1:  # reserved kinds are ignored
        k = rng.choice([0, 2, 3, 0x7F, 0x80, 0xFF])
        return in_case("binary", frame(k, rng.randrange(2 ** 32), rand_bytes(rng, rng.randrange(0, 2000)), rng.randrange(256)),
                       Expect(), note=f"kind {k}: ignored")
    if r == 2:  # PCM16: any even-length payload is audio
        n = 2 * rng.randrange(0, 4000)
        return in_case("binary", frame(1, 0, rand_bytes(rng, n)), Expect(), note="pcm16, random samples")
    if r == 3:  # PCM16, odd byte count
        return in_case("binary", frame(1, 0, rand_bytes(rng, 2 * rng.randrange(0, 500) + 1)),
                       Expect({"bad_audio"}, optional=True), note="pcm16, odd byte count")
    if r == 4:  # nonzero flags / reserved / response_id on a client frame
        f = frame(1, rng.randrange(1, 100), b"\x00\x01" * 160, flags=rng.choice([1, 2, 0xFF]),
                  reserved=rng.choice([0, 1, 0xFFFF]), response_id=rng.choice([0, 1, 0xFFFFFFFF]))
        return in_case("binary", f, Expect({"bad_audio"}, optional=True), note="flags/reserved/response_id set")
    if r == 5:  # Opus that RFC 6716 forbids
        pkt, what = bad_opus(rng)
        return in_case("binary", frame(1, 0, pkt), Expect({"bad_audio"}), create=opus, note=f"opus {what}")
    if r == 6:  # random garbage as Opus
        n = rng.choice([0, 1, 2, 3, 10, 100, 1000, 4000])
        return in_case("binary", frame(1, 0, rand_bytes(rng, n)), Expect({"bad_audio"}, optional=True), create=opus,
                       note="opus, random bytes")
    if r == 7:  # the same input seq twice, and seq at the top of u32
        s = rng.choice([1, 7, 0xFFFFFFFF])
        pcm = b"\x10\x00" * 320
        return in_case("binary", [frame(1, s, pcm), frame(1, s, pcm)], Expect(), note="duplicate input seq")
    if r == 8:  # a burst of bad frames
        frames = [rand_bytes(rng, rng.randrange(0, 12)) for _ in range(30)]
        return in_case("binary", frames, Expect({"bad_audio"}), note="30 truncated frames")
    # a duplex session fed random audio and junk: it lives
    codec = rng.choice(["pcm16", "opus"])
    dup = create_event(codec=codec, mode="duplex", duplex={"policy": "speak_every", "k": 2}, generation=TINY)
    frames = [frame(1, i + 1, rand_bytes(rng, 2 * rng.randrange(1, 1600))) for i in range(rng.randrange(1, 6))]
    frames.append(rand_bytes(rng, rng.randrange(0, 12)))
    return in_case("binary", frames, Expect({"bad_audio"}, optional=True, response="allow"), create=dup,
                   note=f"duplex session, random {codec} then a truncated frame")


# --- size limits -----------------------------------------------------------------------------------

def padded_ping(total):
    base = dumps({"type": "ping", "id": ""})
    return dumps({"type": "ping", "id": "x" * (total - len(base))})


def g_oversize(rng):
    r = variant('oversize', 7)
    too_big = Expect({"message_too_large"}, close=1009, close_error="message_too_large", fatal_ok=True)
    if r == 0:
        s = padded_ping(TEXT_LIMIT)
        return in_case("oversize", s, Expect(pong=(s[len('{"type":"ping","id":"'):-2],)), note="text frame of exactly 256 KiB")
    if r == 1:
        n = rng.choice([TEXT_LIMIT + 1, TEXT_LIMIT + 100, 300000, 600000])
        body = rng.choice([padded_ping(n), "x" * n, dumps({"type": "input.text", "text": "y" * n})[:n]])
        if len(body) < n:
            body = body + " " * (n - len(body))
        return in_case("oversize", body, too_big, note=f"text frame of {n} bytes")
    if r == 2:
        return in_case("oversize", frame(1, 0, b"\x00\x00" * ((BINARY_LIMIT - 12) // 2)), Expect(),
                       note="binary frame of exactly 16 KiB")
    if r == 3:
        n = rng.choice([BINARY_LIMIT + 1, BINARY_LIMIT + 2, 20000, 65536, 200000])
        return in_case("oversize", frame(1, 0, rand_bytes(rng, n - 12)), too_big, note=f"binary frame of {n} bytes")
    if r == 4:
        n = rng.choice([TEXT_LIMIT + 1, 300000])
        return pre_case("oversize", "z" * n, too_big, note=f"text frame of {n} bytes before any session")
    if r == 5:
        return pre_case("oversize", frame(1, 0, bytes(BINARY_LIMIT)), too_big, note="binary frame over 16 KiB before any session")
    # one message over the limit in small fragments: refused as too large, or taken
    s = padded_ping(300000)
    parts = [s[i:i + 4096] for i in range(0, len(s), 4096)]
    return in_case("oversize", Fragments(parts),
                   Expect({"message_too_large"}, optional=True, close_ok=(1009,), fatal_ok=True,
                          pong=(s[len('{"type":"ping","id":"'):-2],)), note="300 KB text message in 4 KiB fragments")


# --- invalid UTF-8 in a text frame -------------------------------------------------------------------

def g_utf8(rng):
    bad = rng.choice([b"\xff", b"\xfe\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80",
                      b"\x80", b"\xf8\x88\x80\x80\x80", b"\xc3"])
    data = b'{"type":"ping","id":"' + bad + b'"}'
    if rng.random() < 0.3:
        data = bad + b"{}"
    # RFC 6455 section 8.1: an endpoint that receives invalid UTF-8 in a text frame fails the connection
    # (close 1007); the contract names no behaviour, so a bad_json that keeps the session is allowed too.
    ex = Expect({"bad_json"}, optional=True, close_ok=(1007,), fatal_ok=True)
    if rng.random() < 0.2:
        return pre_case("utf8", TextBytes(data), ex)
    return in_case("utf8", TextBytes(data), ex)


# --- odd but legal sequences ---------------------------------------------------------------------

def g_sequence(rng):
    r = variant('sequence', 10)
    if r == 0:
        return in_case("sequence", CREATE, Expect(ANY), note="second session.create")
    if r == 1:
        return in_case("sequence", {"type": "input.commit", "generation": TINY},
                       Expect(ANY, optional=True, response="allow"), note="commit with no audio")
    if r == 2:
        return in_case("sequence", [{"type": "input.clear"}] * rng.randrange(1, 20), Expect(ANY, optional=True))
    if r == 3:
        return in_case("sequence", [{"type": "response.cancel"}] * rng.randrange(1, 5), Expect(ANY, optional=True),
                       note="cancel with nothing running")
    if r == 4:
        return Case("sequence", "input.text seq=K, the same again (ignored), then K+1", run_dedup,
                    k=rng.choice([1, 5, 1000, 4294967295]))
    if r == 5:
        return Case("sequence", "a long response, a second input.text and two cancels while it runs", run_overlap)
    if r == 6:
        n = rng.randrange(50, 300)
        return Case("sequence", f"{n} pings back to back", run_ping_burst, n=n)
    if r == 7:
        return in_case("sequence", {"type": "playback", "response_id": 1, "played_ms": rng.choice([0, 10, 10 ** 7])},
                       Expect({"bad_field"}, optional=True), setup=lambda c: c.request(), note="playback after a response")
    if r == 8:
        ev = {"type": "session.update", "output_audio": {"codec": "opus", "frame_ms": rng.choice([10, 20, 40, 60])},
              "generation": {"temperature": 0.5}}
        return in_case("sequence", ev, Expect(), note="valid session.update")
    return in_case("sequence", [{"type": "input.text", "text": "x", "generation": TINY}, {"type": "session.close"}],
                   Expect(close_ok=(1000,), response="allow"), note="close right after a request")


async def run_dedup(ctx, case):
    c = await ctx.session()
    try:
        k = case.k
        await c.request(seq=k)
        start = len(c.log)
        await c.send({"type": "input.text", "text": "again", "generation": TINY, "seq": k})
        msgs = await c.settle(linger=0.4)
        tally(ctx, case, msgs, c)
        p = evaluate(Expect(), c, msgs)
        if p:
            p = ["a resent input.text with an already applied seq was not ignored: " + "; ".join(p)]
        if k < 4294967295:
            await c.request(seq=k + 1)
        await finish(ctx, case, c, c.log[start:], p)
    finally:
        await c.drop()


async def run_overlap(ctx, case):
    c = await ctx.session()
    try:
        await c.send({"type": "input.text", "text": "tell me a long story",
                      "generation": {"max_text_tokens": 200, "min_text_tokens": 200, "max_audio_tokens": 2000,
                                     "min_audio_tokens": 2000}})
        await c.wait_event("response.created")
        await c.send({"type": "input.text", "text": "and another", "generation": TINY})
        await c.send({"type": "response.cancel"})
        await c.send({"type": "response.cancel"})
        msgs = await c.settle(cancel_after=1.0)
        tally(ctx, case, msgs, c)
        p = evaluate(Expect(ANY, optional=True, response="allow"), c, msgs)
        await finish(ctx, case, c, msgs, p)
    finally:
        await c.drop()


async def run_ping_burst(ctx, case):
    c = await ctx.session()
    try:
        ids = list(range(case.n))
        for i in ids:
            await c.send({"type": "ping", "id": i})
        msgs = await c.settle()
        tally(ctx, case, msgs, c)
        got = [m[1].get("id") for m in msgs if m[0] == "event" and m[1].get("type") == "pong"]
        p = evaluate(Expect(), c, msgs)
        if got != ids:
            p.append(f"pongs {got[:10]}… for pings 0..{case.n - 1}: not one each, in order")
        await finish(ctx, case, c, msgs, p)
    finally:
        await c.drop()


# --- fragmented messages -----------------------------------------------------------------------------

def g_fragmented(rng):
    r = variant('fragmented', 3)
    if r == 0:
        s = dumps({"type": "ping", "id": "frag-" + str(rng.randrange(1000))})
        step = rng.randrange(1, 8)
        return in_case("fragmented", Fragments([s[i:i + step] for i in range(0, len(s), step)]),
                       Expect(pong=(json.loads(s)["id"],)))
    if r == 1:
        s = dumps({"type": "input.text", "text": "fragmented hello", "generation": TINY})
        step = rng.randrange(1, 16)
        return in_case("fragmented", Fragments([s[i:i + step] for i in range(0, len(s), step)]), Expect(response="require"))
    pcm = frame(1, 0, b"\x01\x00" * 800)
    step = rng.choice([1, 5, 12, 100])
    return in_case("fragmented", Fragments([pcm[i:i + step] for i in range(0, len(pcm), step)]), Expect())


GENERATORS = [
    ("invalid_json", g_invalid_json, 3), ("non_object", g_non_object, 1), ("event_type", g_event_type, 2),
    ("fields", g_fields, 4), ("absurd_values", g_absurd, 6), ("create", g_create, 4),
    ("generation_huge", g_generation, 2), ("long_strings", g_long, 2), ("nesting", g_nesting, 2),
    ("ack", g_ack, 2), ("resume", g_resume, 3), ("pre_session", g_pre, 2), ("binary", g_binary, 4),
    ("oversize", g_oversize, 2), ("utf8", g_utf8, 1), ("sequence", g_sequence, 2), ("fragmented", g_fragmented, 1),
]


# ---------------------------------------------------------------------------------------------
# health checks

async def reap(ctx):
    """After every case, passed or failed: close what the case left open, resume-and-close what the
    server closed, so that no session stays parked against the server's capacity."""
    for _ in range(3):
        conns = [c for c in LIVE if c is not ctx.bystander]
        LIVE[:] = [c for c in LIVE if c is ctx.bystander]
        if not conns:
            return
        for c in conns:
            try:
                if not c.closed and c.in_session:
                    await asyncio.wait_for(c.close_session(), 5)
                elif c.closed and c.sid and not c.we_closed:
                    await asyncio.wait_for(cleanup(ctx, c), 10)
            except Exception:
                pass
            await c.drop()

async def health(ctx, full):
    c = await Conn.open_(ctx.url, "health")
    try:
        await c.send(CREATE)
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = await c.recv_by(deadline, "session.created on a fresh socket")
            if m[0] == "closed" or (m[0] == "event" and m[1].get("type") == "error"):
                raise Failure(f"a fresh socket could not create a session: {summarize(c.log)}")
            if m[0] == "event" and m[1].get("type") == "session.created":
                break
        await c.ping()
        if full:
            await c.request("hello")
        await c.close_session()
        if c.violations:
            raise Failure("; ".join(c.violations))
    finally:
        await c.drop()


async def check_bystander(ctx, full=True):
    b = ctx.bystander
    start = len(b.log)
    try:
        await b.ping()
        if full:
            await b.request("bystander")
    except Failure as f:
        raise Failure(f"the bystander session broke: {f}")
    bad = [m for m in b.log[start:] if m[0] == "event" and m[1].get("type") in ("error", "session.closing")]
    idle = [m for m in bad if m[1].get("type") == "session.closing" and m[1].get("reason") == "idle"]
    if b.violations or (bad and not idle):
        v = b.violations[:]
        b.violations.clear()
        raise Failure(f"the bystander session was disturbed: {'; '.join(v)} {summarize(bad)}")
    if idle:
        await b.drop()
        ctx.bystander = await ctx.session(label="bystander")


# ---------------------------------------------------------------------------------------------

async def main():
    global TIMEOUT, ALLOW_REPLACED_SEQ0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=20.0, help="every wait, seconds (a hang is a failure)")
    ap.add_argument("--full-every", type=int, default=5,
                    help="a fresh socket completes a minimal input.text every N cases (a ping after every case)")
    ap.add_argument("--only", help="comma-separated categories to run")
    ap.add_argument("--case", type=int, action="append",
                    help="run only case I of this seed (repeatable): reproduces a reported failure")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case")
    ap.add_argument("--allow-replaced-seq0", action="store_true",
                    help="accept session.closing `replaced` with seq 0 (antiphon documents it as connection-level)")
    a = ap.parse_args()
    TIMEOUT = a.timeout
    ALLOW_REPLACED_SEQ0 = a.allow_replaced_seq0
    rng = random.Random(a.seed)
    gens = [g for g in GENERATORS if not a.only or g[0] in a.only.split(",")]
    import inspect
    from websockets.asyncio.connection import Connection
    if "text" not in inspect.signature(Connection.send).parameters:
        print(f"skip  utf8: websockets {websockets.__version__} cannot send bytes as a text frame (needs >= 14)")
        gens = [g for g in gens if g[0] != "utf8"]
    if not gens:
        sys.exit(f"no category among {a.only}")
    ctx = Ctx(a.url)
    t_start = time.monotonic()
    try:
        await health(ctx, True)
        ctx.bystander = await ctx.session(label="bystander")
        await ctx.bystander.request("bystander")
    except Failure as f:
        print(f"FAIL  the server does not work before any fuzzing: {f}")
        print("fuzz: 0 cases, 1 failures")
        sys.exit(1)
    stats = {g[0]: [0, 0] for g in gens}
    failures = []
    down = 0
    weights = [g[2] for g in gens]
    for i in range(a.cases if not a.case else max(a.case) + 1):
        name, gen, _ = gens[i] if i < len(gens) else rng.choices(gens, weights)[0]
        case_rng = random.Random(f"{a.seed}/{i}")
        case = gen(case_rng)  # generated even when skipped: the variant rotation stays the same
        if a.case and i not in a.case:
            continue
        stats[case.cat][0] += 1
        t0 = time.monotonic()
        problem = None
        try:
            await asyncio.wait_for(case.run(ctx, case), 4 * TIMEOUT)
        except Failure as f:
            problem = str(f)
        except asyncio.TimeoutError:
            problem = f"hang: the case did not finish within {4 * TIMEOUT:.0f} s"
        except Exception as e:  # a bug in this client; reported, counted
            problem = f"client exception {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        await reap(ctx)
        try:
            await asyncio.wait_for(health(ctx, i % a.full_every == 0), 4 * TIMEOUT)
            if i % 10 == 9:
                await asyncio.wait_for(check_bystander(ctx), 4 * TIMEOUT)
            down = 0
        except (Failure, asyncio.TimeoutError) as f:
            problem = (problem + "\n      " if problem else "") + f"after this case, the server check failed: {f or 'hang'}"
            down += 1
        dt = time.monotonic() - t0
        if problem:
            stats[case.cat][1] += 1
            failures.append((i, case, problem))
            print(f"FAIL  case {i} [{case.cat}] {case.desc}\n      {problem}", flush=True)
        elif a.verbose:
            print(f"ok    case {i} [{case.cat}] {dt * 1000:.0f} ms  {case.desc[:150]}", flush=True)
        if down >= 3:
            print("the server is down or stuck: stopping", flush=True)
            break
    try:
        await asyncio.wait_for(check_bystander(ctx), 4 * TIMEOUT)
        await ctx.bystander.close_session()
    except (Failure, asyncio.TimeoutError) as f:
        failures.append((-1, None, f"bystander at the end: {f}"))
        print(f"FAIL  the bystander session at the end: {f}")
    elapsed = time.monotonic() - t_start
    for name, (n, f) in stats.items():
        seen = ctx.outcomes.get(name, {})
        outs = ", ".join(f"{k}×{v}" for k, v in sorted(seen.items(), key=lambda kv: -kv[1]))
        print(f"{name:<16} {n:4d} cases {f:3d} failures   {outs}")
    total = sum(n for n, _ in stats.values())
    print(f"({elapsed:.0f} s)")
    print(f"fuzz: {total} cases, {len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    asyncio.run(main())
