// The wire protocol v1 (docs/protocol.md) as a small browser client: sequence numbers and acks
// both ways, a resend buffer of the input the server has not applied yet, and automatic
// reconnection with backoff and `session.resume`. Messages the server replays after a resume are
// told apart by their `seq`: one already held is dropped, so nothing plays twice and, with
// `last_seq` sent on resume, nothing is skipped.

export const KIND_AUDIO = 1;
export const FLAG_LAST = 1;

/** One binary audio frame: 12-byte little-endian header, then the payload. */
export function audioFrame(seq, payload, responseId = 0, flags = 0) {
  const buf = new Uint8Array(12 + payload.byteLength);
  const dv = new DataView(buf.buffer);
  dv.setUint8(0, KIND_AUDIO);
  dv.setUint8(1, flags);
  dv.setUint32(4, seq, true);
  dv.setUint32(8, responseId, true);
  buf.set(new Uint8Array(payload.buffer ? payload.buffer.slice(payload.byteOffset, payload.byteOffset + payload.byteLength) : payload), 12);
  return buf;
}

export function parseFrame(data) {
  const dv = new DataView(data);
  return { kind: dv.getUint8(0), flags: dv.getUint8(1), seq: dv.getUint32(4, true), responseId: dv.getUint32(8, true), payload: new Uint8Array(data, 12) };
}

/** The URL of a resume: the session id in the query (`?session_id=`), beside any there already. */
export function resumeUrl(url, sessionId) {
  const u = new URL(url);
  u.searchParams.set('session_id', sessionId);
  return u.toString();
}

export class Client extends EventTarget {
  /**
   * @param {string} url  ws:// or wss:// URL of /v1/realtime
   * @param {object} create  the session.create event
   */
  constructor(url, create) {
    super();
    this.url = url;
    this.create = create;
    this.session = null; // {id, token}
    this.lastSeq = 0; // highest server seq held
    this.acked = 0;
    this.inputSeq = 0;
    this.outbox = []; // [{seq, data}] sent or waiting, not yet applied by the server
    this.ready = false; // session created or resumed on the current socket
    this.state = 'idle';
    this.reconnects = 0;
    this.duplicates = 0;
    this.attempt = 0;
    this.stopped = false;
    this.ackTimer = setInterval(() => this.flushAck(), 250);
  }

  setState(s, detail = '') {
    this.state = s;
    this.dispatchEvent(new CustomEvent('state', { detail: { state: s, detail } }));
  }

  connect() {
    this.setState(this.session ? 'reconnecting' : 'connecting');
    // a resume names its session in the URL too: a proxy routes it to the replica that holds it
    const ws = new WebSocket(this.session ? resumeUrl(this.url, this.session.id) : this.url);
    ws.binaryType = 'arraybuffer';
    this.ws = ws;
    ws.onopen = () => {
      this.attempt = 0;
      if (this.session) {
        ws.send(JSON.stringify({ type: 'session.resume', session_id: this.session.id, resume_token: this.session.token, last_seq: this.lastSeq }));
      } else {
        ws.send(JSON.stringify(this.create));
      }
    };
    ws.onmessage = (e) => (typeof e.data === 'string' ? this.onEvent(JSON.parse(e.data)) : this.onAudio(e.data));
    ws.onclose = () => {
      if (this.ws !== ws) return;
      this.ready = false;
      if (this.stopped) {
        this.setState('closed');
        return;
      }
      // back off: 250 ms, 500 ms, 1 s … 4 s, with jitter
      const delay = Math.min(4000, 250 * 2 ** this.attempt++) * (0.75 + Math.random() * 0.5);
      this.setState('reconnecting', `in ${Math.round(delay)} ms`);
      this.retry = setTimeout(() => {
        this.reconnects++;
        this.connect();
      }, delay);
    };
  }

  /** Ends the session for good (`session.close`). */
  close() {
    this.stopped = true;
    clearTimeout(this.retry);
    clearInterval(this.ackTimer);
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ type: 'session.close' }));
    }
    this.setState('closed');
  }

  /** Drops the socket without closing the session (a network drop, for the demo's button). */
  drop() {
    if (this.ws) this.ws.close();
  }

  /** A conversation event: numbered, kept until the server applied it, resent after a resume. */
  send(event) {
    const seq = ++this.inputSeq;
    this.enqueue(seq, JSON.stringify({ ...event, seq }));
    return seq;
  }

  /** One input audio packet (Opus or PCM16 bytes). */
  sendAudio(bytes) {
    const seq = ++this.inputSeq;
    this.enqueue(seq, audioFrame(seq, bytes));
    return seq;
  }

  enqueue(seq, data) {
    this.outbox.push({ seq, data });
    if (this.ready) this.ws.send(data);
  }

  /** Connection-level events (no seq, never resent). */
  control(event) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(event));
  }

  flushAck() {
    if (this.ready && this.lastSeq > this.acked) {
      this.control({ type: 'ack', seq: this.lastSeq });
      this.acked = this.lastSeq;
    }
  }

  applied(inputSeq) {
    while (this.outbox.length && this.outbox[0].seq <= inputSeq) this.outbox.shift();
  }

  /** True if this seq is new (and records it). */
  fresh(seq) {
    if (seq === undefined || seq === null) return true;
    if (seq <= this.lastSeq) {
      this.duplicates++;
      return false;
    }
    this.lastSeq = seq;
    return true;
  }

  onEvent(m) {
    if (!this.fresh(m.seq)) return;
    switch (m.type) {
      case 'session.created':
        this.session = { id: m.session_id, token: m.resume_token };
        this.ready = true;
        this.setState('connected');
        for (const o of this.outbox) this.ws.send(o.data);
        break;
      case 'session.resumed':
        this.ready = true;
        this.applied(m.input_seq);
        this.setState('connected', 'resumed');
        for (const o of this.outbox) this.ws.send(o.data);
        break;
      case 'ack':
        if (m.input_seq !== undefined) this.applied(m.input_seq);
        break;
      case 'session.closing':
        if (m.reason === 'replaced') this.stopped = true;
        break;
      case 'error':
        if (['session_expired', 'session_not_found', 'bad_resume_token'].includes(m.code)) {
          // the old session cannot be resumed: start a new one, on this socket (it stays open)
          this.session = null;
          this.lastSeq = 0;
          this.acked = 0;
          this.outbox = [];
          if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(this.create));
          break;
        }
        if (m.fatal) this.stopped = true;
        break;
    }
    this.dispatchEvent(new CustomEvent('event', { detail: m }));
  }

  onAudio(data) {
    const f = parseFrame(data);
    if (f.kind !== KIND_AUDIO || !this.fresh(f.seq)) return;
    this.dispatchEvent(new CustomEvent('audio', { detail: f }));
  }
}
