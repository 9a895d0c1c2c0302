// The antiphon voice-chat demo: microphone in (AudioWorklet → WebCodecs Opus, PCM16 where
// WebCodecs is missing), the protocol client of client.js, Opus out through WebCodecs into an
// AudioWorklet jitter buffer, and the figures a user wants to see: time to first audio of each
// response, buffer depth, stalls, connection state.
import { Client, FLAG_LAST } from './client.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);

// Everything the page measures, also read by the end-to-end tests.
const stats = {
  state: 'idle',
  codecIn: '',
  codecOut: '',
  sentPackets: 0,
  audioPackets: 0,
  audioSeqs: [], // every audio seq received (after dropping replays already held)
  seqs: [], // every server seq received, events and audio
  playedSamples: 0,
  depthMs: 0,
  stalls: 0,
  stallMs: 0,
  ttfa: [], // ms, one per response
  responses: {}, // id -> {packets, donePackets, status, cancelled}
  reconnects: 0,
  resumes: [], // {applied: the server's input_seq, sent: the client's} at each resume
  unapplied: 0, // input the server has not confirmed yet
  duplicates: 0,
  events: [],
  activity: [], // the page's listening / thinking / speaking states, in the order shown
  outPeak: 0, // the loudest the assistant's meter showed
};
// (the client itself, for the end-to-end tests)
window.antiphon = { stats, client: () => client };

let client = null;
let audioCtx = null;
let player = null;
let micNode = null;
let micStream = null;
let encoder = null;
let decoder = null;
let outRate = 24000;
let inputEnd = null; // when the user's last turn was complete (TTFA starts here)
let current = null; // the response being received: {id, start, first, ms}
let talking = false; // push-to-talk held, or the VAD hears speech (hands-free)
let vadQuiet = 0;
let lastLoud = 0; // when the VAD last heard speech (hands-free: the turn ended there)
let turnFrames = 0; // 20 ms frames of the caller's turn in progress
const preroll = []; // the last 200 ms before speech starts (hands-free)

function log(msg) {
  const line = `${new Date().toISOString().slice(11, 23)} ${msg}`;
  stats.events.push(line);
  const el = $('log');
  el.textContent = (line + '\n' + el.textContent).slice(0, 6000);
}

// ---- the conversation as the page shows it ----------------------------------------------

/** A line of the conversation: the caller's (`you`) or the assistant's. */
function say(who, text) {
  const li = document.createElement('li');
  li.className = who;
  li.innerHTML = `<b>${who === 'you' ? 'you' : 'assistant'}</b><span></span>`;
  li.lastChild.textContent = text;
  const list = $('conversation');
  list.append(li);
  list.scrollTop = list.scrollHeight;
  return li;
}

/** Who is doing what: the caller talking, the assistant thinking (asked, no audio yet) or speaking. */
function updateActivity() {
  let a = 'idle';
  if (client && client.session) {
    const r = current && stats.responses[current.id];
    if (talking) a = 'listening';
    else if (r && r.status === null && !r.cancelled) a = current.first === null ? 'thinking' : 'speaking';
    else if (stats.depthMs > 0) a = 'speaking';
    else a = $('mode').value === 'duplex' || $('handsfree').checked ? 'listening' : 'ready';
  }
  if (stats.activity[stats.activity.length - 1] !== a) {
    stats.activity.push(a);
    if (stats.activity.length > 200) stats.activity.shift();
    $('activity').textContent = a;
    $('activity').className = 'activity ' + a;
  }
}

/** The TTFA of each turn so far, as a small line plot. */
function plotTtfa() {
  const v = stats.ttfa.slice(-20);
  const svg = $('ttfaplot');
  const w = Number(svg.getAttribute('width'));
  const h = Number(svg.getAttribute('height'));
  const max = Math.max(...v, 1);
  const pts = v.map((t, i) => `${v.length > 1 ? ((i * (w - 4)) / (v.length - 1) + 2).toFixed(1) : w / 2},${(h - 2 - (t / max) * (h - 4)).toFixed(1)}`);
  svg.innerHTML = `<polyline fill="none" stroke="#36c" stroke-width="1.5" points="${pts.join(' ')}"/>` + pts.map((p) => `<circle r="1.8" fill="#36c" cx="${p.split(',')[0]}" cy="${p.split(',')[1]}"/>`).join('');
}

/** The hands-free threshold marked on the caller's meter (the meter shows 8 × the RMS). */
function markThreshold() {
  $('threshold-mark').style.left = `${Math.min(1, Number($('threshold').value) * 8) * 100}%`;
}

function setState(s, detail) {
  stats.state = s;
  $('state').textContent = s + (detail ? ` (${detail})` : '');
  $('state').className = 'state ' + s;
}

async function buildInfo() {
  try {
    const b = await (await fetch('/api/build_info')).json();
    const note = $('note');
    if (b.synthetic_weights) {
      note.hidden = false;
      note.innerHTML =
        `This server runs <b>synthetic weights</b> (${b.model.preset} preset): it answers with babble, not speech, ` +
        'with forced lengths. Point <code>[model]</code> at a MiniCPM-o 4.5 checkpoint for real speech.';
    }
    const sel = $('voice');
    for (const v of b.voices || []) sel.add(new Option(v, v));
    // and the voices this browser kept on the server (not every visitor's: a registered voice is
    // somebody's recording), where the server still has them
    const mine = keptVoices();
    if (mine.length) {
      try {
        const r = await fetch('/v1/voices' + tokenQuery('?'));
        const held = r.ok ? new Set((await r.json()).voices.map((v) => v.id)) : new Set();
        for (const v of mine) if (held.has(v.id)) sel.add(new Option(`${v.name} (${v.id})`, v.id));
      } catch (e) {
        log('voices: ' + e);
      }
    }
    $('build').textContent = `antiphon ${b.version} · ${b.model.source} ${b.model.preset} · ${b.model.device}`;
    return b;
  } catch (e) {
    log('build_info: ' + e);
    return {};
  }
}

function wsUrl() {
  const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
  const token = params.get('token');
  return `${proto}//${location.host}/v1/realtime${token ? '?token=' + encodeURIComponent(token) : ''}`;
}

// ---- audio out ---------------------------------------------------------------------------

function resample(x, from, to) {
  if (from === to) return x;
  const n = Math.floor((x.length * to) / from);
  const y = new Float32Array(n);
  const r = from / to;
  for (let i = 0; i < n; i++) {
    const p = i * r;
    const j = Math.floor(p);
    const f = p - j;
    y[i] = x[j] * (1 - f) + (j + 1 < x.length ? x[j + 1] : x[j]) * f;
  }
  return y;
}

/** The timestamp (µs) of the last packet given to the decoder before the latest barge-in. */
let dropThrough = -1;

function play(samples, rate) {
  player.port.postMessage({ type: 'push', samples: resample(samples, rate, audioCtx.sampleRate) });
}

function makeDecoder() {
  if (typeof AudioDecoder === 'undefined' || params.get('pcm') === '1') return null;
  const d = new AudioDecoder({
    output: (data) => {
      // decoded after a barge-in from packets sent before it: not to be heard
      if (data.timestamp <= dropThrough) return data.close();
      const pcm = new Float32Array(data.numberOfFrames);
      data.copyTo(pcm, { planeIndex: 0, format: 'f32-planar' });
      play(pcm, data.sampleRate);
      data.close();
    },
    error: (e) => log('decoder: ' + e),
  });
  d.configure({ codec: 'opus', sampleRate: outRate, numberOfChannels: 1 });
  return d;
}

function onAudio(f) {
  stats.seqs.push(f.seq);
  stats.audioPackets++;
  stats.audioSeqs.push(f.seq);
  const r = (stats.responses[f.responseId] ||= { packets: 0, donePackets: null, status: null, cancelled: false });
  r.packets++;
  if (r.cancelled) return;
  if (current && current.id === f.responseId && current.first === null) {
    current.first = performance.now();
    const ttfa = Math.round(current.first - current.start);
    stats.ttfa.push(ttfa);
    $('ttfa').textContent = `${ttfa} ms`;
    $('ttfas').textContent = stats.ttfa.slice(-8).join(' · ');
    plotTtfa();
  }
  if (decoder) {
    decoder.decode(new EncodedAudioChunk({ type: 'key', timestamp: stats.audioPackets * 20000, data: f.payload }));
  } else {
    const dv = new DataView(f.payload.buffer, f.payload.byteOffset, f.payload.byteLength);
    const pcm = new Float32Array(f.payload.byteLength / 2);
    for (let i = 0; i < pcm.length; i++) pcm[i] = dv.getInt16(2 * i, true) / 32768;
    play(pcm, outRate);
  }
  if (f.flags & FLAG_LAST) {
    const end = () => player.port.postMessage({ type: 'end' });
    decoder ? decoder.flush().then(end, end) : end();
  }
}

function onEvent(m) {
  if (m.seq !== undefined) stats.seqs.push(m.seq);
  switch (m.type) {
    case 'session.created':
      log(`session ${m.session_id} (${m.mode}), resumable for ${m.resume_grace_s} s`);
      outRate = 24000;
      break;
    case 'session.resumed':
      stats.resumes.push({ applied: m.input_seq, sent: client.inputSeq });
      log(`resumed; the server had applied input up to ${m.input_seq} of ${client.inputSeq}; resending the rest`);
      break;
    case 'response.created':
      current = { id: m.response_id, start: inputEnd ?? performance.now(), first: null, playedAtStart: stats.playedSamples, line: say('assistant', '') };
      stats.responses[m.response_id] ||= { packets: 0, donePackets: null, status: null, cancelled: false };
      inputEnd = null;
      log(`response ${m.response_id} (${m.trigger})`);
      break;
    case 'response.text.delta':
      if (current && current.id === m.response_id) current.line.lastChild.textContent += m.text;
      break;
    case 'response.done': {
      const r = (stats.responses[m.response_id] ||= { packets: 0, donePackets: null, status: null, cancelled: false });
      r.donePackets = m.packets;
      r.audioMs = m.audio_ms;
      r.status = m.status;
      const line = [...$('conversation').querySelectorAll('li.assistant')].pop();
      if (m.status !== 'completed' && line) line.firstChild.textContent = `assistant (${m.status})`;
      log(`response ${m.response_id} ${m.status}: ${m.packets} packets, ${m.audio_ms} ms of audio`);
      break;
    }
    case 'duplex.listen':
    case 'duplex.speak':
      $('duplex').textContent = `unit ${m.unit}: ${m.type.slice(7)}`;
      break;
    case 'error':
      log(`error ${m.code}: ${m.message}${m.fatal ? ' (fatal)' : ''}`);
      break;
    case 'session.closing':
      log(`server closing the session: ${m.reason}`);
      break;
  }
}

// ---- audio in ----------------------------------------------------------------------------

function makeEncoder(rate) {
  if (typeof AudioEncoder === 'undefined' || params.get('pcm') === '1') return null;
  const e = new AudioEncoder({
    output: (chunk) => {
      const bytes = new Uint8Array(chunk.byteLength);
      chunk.copyTo(bytes);
      if (!client) return;
      client.sendAudio(bytes);
      stats.sentPackets++;
    },
    error: (err) => log('encoder: ' + err),
  });
  e.configure({ codec: 'opus', sampleRate: rate, numberOfChannels: 1, bitrate: 32000, opus: { frameDuration: 20000 } });
  return e;
}

let micTime = 0;
function send(frame) {
  turnFrames++;
  if (encoder) {
    encoder.encode(new AudioData({ format: 'f32-planar', sampleRate: audioCtx.sampleRate, numberOfFrames: frame.length, numberOfChannels: 1, timestamp: micTime, data: frame }));
    micTime += (frame.length / audioCtx.sampleRate) * 1e6;
  } else {
    const pcm = new Int16Array(frame.length);
    for (let i = 0; i < frame.length; i++) pcm[i] = Math.max(-32768, Math.min(32767, Math.round(frame[i] * 32767)));
    client.sendAudio(new Uint8Array(pcm.buffer));
    stats.sentPackets++;
  }
}

function assistantSpeaking() {
  if (!current) return false;
  const r = stats.responses[current.id];
  return stats.depthMs > 0 || (r && r.status === null);
}

/** Barge-in (turn mode): stop the answer, drop what is queued, tell the server what was heard. */
function bargeIn() {
  if (!current) return;
  const r = stats.responses[current.id];
  if (r) r.cancelled = true;
  const heard = Math.max(0, Math.round(((stats.playedSamples - (current.playedAtStart ?? 0)) / audioCtx.sampleRate) * 1000));
  client.send({ type: 'response.cancel', response_id: current.id });
  client.send({ type: 'playback', response_id: current.id, played_ms: heard });
  player.port.postMessage({ type: 'flush' });
  dropThrough = stats.audioPackets * 20000;
  log(`barge-in: response ${current.id} cancelled after ${heard} ms heard`);
  current = null;
}

/** Ends the caller's turn: `endedAt` is when the speech ended (hands-free: before the quiet that
 *  ended it, so the TTFA shown counts that quiet as the caller's wait). */
async function commit(endedAt = performance.now()) {
  const seconds = ((turnFrames * 20) / 1000).toFixed(1);
  turnFrames = 0;
  if (encoder) await encoder.flush();
  if (!client) return;
  client.send({ type: 'input.commit' });
  inputEnd = endedAt;
  say('you', `you said ${seconds} s of audio`);
  log(`turn committed (${stats.sentPackets} packets sent so far)`);
  updateActivity();
}

function onMicFrame(frame) {
  let e = 0;
  for (const s of frame) e += s * s;
  const rms = Math.sqrt(e / frame.length);
  $('level').value = Math.min(1, rms * 8);
  // while reconnecting, input goes to the client's resend buffer and leaves on resume
  if (!client || !client.session) return;
  const mode = $('mode').value;
  if (mode === 'duplex') {
    send(frame);
    return;
  }
  if ($('handsfree').checked) {
    const loud = rms > Number($('threshold').value);
    if (loud) lastLoud = performance.now();
    if (!talking) {
      preroll.push(frame);
      if (preroll.length > 10) preroll.shift();
      if (loud) {
        talking = true;
        vadQuiet = 0;
        turnFrames = 0;
        if (assistantSpeaking()) bargeIn();
        for (const f of preroll.splice(0)) send(f);
        $('ptt').classList.add('on');
        updateActivity();
      }
      return;
    }
    send(frame);
    vadQuiet = loud ? 0 : vadQuiet + 1;
    if (vadQuiet >= 40) {
      // 800 ms of quiet ends the turn: the caller stopped speaking when it began
      talking = false;
      $('ptt').classList.remove('on');
      commit(lastLoud || performance.now());
    }
    return;
  }
  if (talking) send(frame);
}

// ---- session -----------------------------------------------------------------------------

/** Controls enabled exactly when they work: the session's settings while idle, talking while
 *  connected (typing and push-to-talk in turn mode only: duplex listens all the time). */
function lockControls(connected) {
  for (const id of ['mode', 'voice', 'ref', 'keep', 'connect']) $(id).disabled = connected;
  for (const id of ['hangup', 'drop']) $(id).disabled = !connected;
  const duplex = $('mode').value === 'duplex';
  for (const id of ['text', 'send', 'ptt']) $(id).disabled = !connected || duplex;
}

/** Something went wrong that the user must see: on the page, in the log and the state line. */
function showError(what, e) {
  const msg = `${what}: ${e && e.message ? e.message : e}`;
  log('error: ' + msg);
  setState('error', msg);
}

/** Connects, or shows why not and leaves the page ready to try again. */
async function start(info) {
  if (client) return;
  lockControls(true);
  try {
    await open(info);
  } catch (e) {
    await stop();
    showError('could not connect', e);
  }
}

/** Hang up: ends the session and frees the microphone and audio, ready to connect again. */
async function stop() {
  if (client) client.close();
  client = null;
  clearInterval(statsTimer);
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  micStream = null;
  micNode = null;
  if (encoder && encoder.state !== 'closed') encoder.close();
  if (decoder && decoder.state !== 'closed') decoder.close();
  encoder = decoder = null;
  if (audioCtx) await audioCtx.close().catch(() => {});
  audioCtx = null;
  player = null;
  current = null;
  talking = false;
  $('ptt').classList.remove('on');
  lockControls(false);
}

let statsTimer = null;

async function open(info) {
  const ctx = (audioCtx = new AudioContext({ sampleRate: 48000, latencyHint: 'interactive' }));
  await audioCtx.audioWorklet.addModule('worklets.js');
  player = new AudioWorkletNode(audioCtx, 'player', { outputChannelCount: [1] });
  player.connect(audioCtx.destination);
  player.port.onmessage = (e) => {
    // (a hung-up call's last messages: its context is gone)
    if (audioCtx !== ctx) return;
    const m = e.data;
    stats.playedSamples = m.played;
    stats.depthMs = Math.round((m.depth / audioCtx.sampleRate) * 1000);
    stats.stalls = m.stalls;
    stats.stallMs = Math.round(m.stallMs);
    $('depth').textContent = `${stats.depthMs} ms`;
    $('stalls').textContent = `${stats.stalls} (${stats.stallMs} ms)`;
    $('played').textContent = `${(m.played / audioCtx.sampleRate).toFixed(1)} s`;
    $('outlevel').value = Math.min(1, (m.level || 0) * 8);
    stats.outPeak = Math.max(stats.outPeak, $('outlevel').value);
    updateActivity();
  };
  try {
    micStream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true } });
    micNode = new AudioWorkletNode(audioCtx, 'capture');
    audioCtx.createMediaStreamSource(micStream).connect(micNode);
    micNode.port.onmessage = (e) => audioCtx === ctx && onMicFrame(e.data);
  } catch (e) {
    log('no microphone: ' + e.message + ' (text input still works)');
  }
  encoder = makeEncoder(audioCtx.sampleRate);
  decoder = makeDecoder();
  stats.codecIn = encoder ? 'opus' : 'pcm16';
  stats.codecOut = decoder ? 'opus' : 'pcm16';
  $('codecs').textContent = `in ${stats.codecIn} ${audioCtx.sampleRate / 1000} kHz · out ${stats.codecOut} 24 kHz`;

  const mode = $('mode').value;
  const create = {
    type: 'session.create',
    mode,
    input_audio: { codec: stats.codecIn, sample_rate: audioCtx.sampleRate },
    output_audio: { codec: stats.codecOut, frame_ms: 20 },
    voice: await voiceChoice(),
  };
  if (info.synthetic_weights) {
    // synthetic weights decide nothing: force lengths, and speak every other unit in duplex. A
    // duplex unit speaks its own length (one unit of codes); what a turn says after its last unit
    // (its drain, to the end code that synthetic weights never pick) is kept short, or the audio
    // would outgrow the units and the buffer drift behind.
    const text = Number(params.get('text_tokens') || 16);
    const audio = Number(params.get('audio_tokens') || 75);
    create.generation = { min_text_tokens: text, max_text_tokens: text, min_audio_tokens: audio, max_audio_tokens: audio };
    if (mode === 'duplex') {
      create.duplex = { policy: 'speak_every', k: Number(params.get('speak_every') || 2) };
      Object.assign(create.generation, { min_audio_tokens: 0, max_audio_tokens: Number(params.get('drain_tokens') || 10) });
    }
  }
  client = new Client(wsUrl(), create);
  // (a session hung up may still deliver a last message: it is not this page's any more)
  const mine = client;
  client.addEventListener('state', (e) => {
    if (client !== mine) return;
    setState(e.detail.state, e.detail.detail);
    stats.reconnects = client.reconnects;
    $('reconnects').textContent = client.reconnects;
  });
  client.addEventListener('event', (e) => client === mine && onEvent(e.detail));
  client.addEventListener('audio', (e) => client === mine && onAudio(e.detail));
  statsTimer = setInterval(() => {
    if (!client) return;
    stats.duplicates = client.duplicates;
    stats.unapplied = client.outbox.length;
    $('dups').textContent = client.duplicates;
  }, 250);
  client.connect();
}

/** `?token=…` (or `&token=…`) when the page was opened with one, else nothing. */
function tokenQuery(sep) {
  const token = params.get('token');
  return token ? `${sep}token=${encodeURIComponent(token)}` : '';
}

/** The voices this browser registered: [{id, name}] (localStorage). */
function keptVoices() {
  try {
    return JSON.parse(localStorage.getItem('antiphon.voices') || '[]');
  } catch {
    return [];
  }
}

/** 16 kHz mono PCM16 samples as a WAV file. */
function wavBlob(pcm, rate) {
  const h = new DataView(new ArrayBuffer(44));
  const text = (at, s) => [...s].forEach((c, i) => h.setUint8(at + i, c.charCodeAt(0)));
  text(0, 'RIFF');
  h.setUint32(4, 36 + pcm.byteLength, true);
  text(8, 'WAVEfmt ');
  h.setUint32(16, 16, true);
  h.setUint16(20, 1, true); // PCM
  h.setUint16(22, 1, true); // mono
  h.setUint32(24, rate, true);
  h.setUint32(28, 2 * rate, true);
  h.setUint16(32, 2, true);
  h.setUint16(34, 16, true);
  text(36, 'data');
  h.setUint32(40, pcm.byteLength, true);
  return new Blob([h.buffer, pcm.buffer], { type: 'audio/wav' });
}

/**
 * The voice: a configured one (or one this browser kept), or an uploaded recording in any format
 * the browser decodes, cut to its first 6 s of 16 kHz mono PCM16 (what the model uses of it). An
 * upload goes inline with this session only (it fits the protocol's 256 KiB text frame once in
 * base64) unless "keep it on the server" is checked: then it is registered (`POST /v1/voices`)
 * and named by its id from then on, in this browser only; where the registry refuses it, it goes
 * inline.
 */
async function voiceChoice() {
  const file = $('ref').files[0];
  if (!file) return { id: $('voice').value || 'default' };
  let decoded;
  try {
    decoded = await audioCtx.decodeAudioData(await file.arrayBuffer());
  } catch (e) {
    $('ref').value = '';
    throw new Error(`${file.name} cannot be decoded as audio (${e.message || e}); pick another file or a voice`);
  }
  const mono = new Float32Array(decoded.length);
  for (let c = 0; c < decoded.numberOfChannels; c++) {
    const ch = decoded.getChannelData(c);
    for (let i = 0; i < mono.length; i++) mono[i] += ch[i] / decoded.numberOfChannels;
  }
  const pcm16k = resample(mono, decoded.sampleRate, 16000).subarray(0, 16000 * 6);
  const pcm = new Int16Array(pcm16k.length);
  for (let i = 0; i < pcm.length; i++) pcm[i] = Math.max(-32768, Math.min(32767, Math.round(pcm16k[i] * 32767)));
  const secs = (pcm.length / 16000).toFixed(1);
  if (!$('keep').checked) return inlineVoice(pcm, file.name, secs);
  try {
    const name = encodeURIComponent(file.name.slice(0, 64));
    const r = await fetch(`/v1/voices?name=${name}${tokenQuery('&')}`, { method: 'POST', headers: { 'Content-Type': 'audio/wav' }, body: wavBlob(pcm, 16000) });
    const v = await r.json();
    if (r.ok) {
      log(`reference voice: ${file.name}, ${secs} s registered as ${v.id} (kept on the server)`);
      localStorage.setItem('antiphon.voices', JSON.stringify([...keptVoices(), { id: v.id, name: v.name }]));
      const sel = $('voice');
      sel.add(new Option(`${v.name} (${v.id})`, v.id));
      sel.value = v.id;
      $('ref').value = '';
      return { id: v.id };
    }
    log(`voice registry refused it (${v.error ? v.error.message : r.status}); sending it with the session`);
  } catch (e) {
    log(`voice registry: ${e}; sending it with the session`);
  }
  return inlineVoice(pcm, file.name, secs);
}

/** A recording that goes with this session only (16 kHz PCM16 inline; the server keeps nothing). */
function inlineVoice(pcm, name, secs) {
  const bytes = new Uint8Array(pcm.buffer);
  let bin = '';
  for (let i = 0; i < bytes.length; i += 0x8000) bin += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  log(`reference voice: ${name}, ${secs} s for this call only (not kept)`);
  return { ref_audio_b64: btoa(bin), sample_rate: 16000 };
}

function sendText() {
  const text = $('text').value.trim();
  if (!text || !client) return;
  if (assistantSpeaking()) bargeIn();
  client.send({ type: 'input.text', text });
  inputEnd = performance.now();
  $('text').value = '';
  say('you', text);
}

async function main() {
  const info = await buildInfo();
  setState('idle');
  lockControls(false);
  $('mode').onchange = () => lockControls(false);
  $('connect').onclick = () => start(info);
  $('hangup').onclick = async () => {
    await stop();
    setState('idle', 'hung up');
    log('hung up');
  };
  $('drop').onclick = () => client && client.drop();
  $('send').onclick = sendText;
  $('text').onkeydown = (e) => e.key === 'Enter' && sendText();
  const ptt = $('ptt');
  const down = () => {
    if (!client) return;
    if ($('handsfree').checked) {
      // hands-free: the button ends the turn in progress now, without waiting for the quiet
      if (talking) {
        talking = false;
        ptt.classList.remove('on');
        commit();
      }
      return;
    }
    if (assistantSpeaking()) bargeIn();
    talking = true;
    turnFrames = 0;
    ptt.classList.add('on');
    updateActivity();
  };
  const up = () => {
    if (!talking || $('handsfree').checked) return;
    talking = false;
    ptt.classList.remove('on');
    if ($('mode').value === 'turn') commit();
  };
  $('threshold').oninput = markThreshold;
  markThreshold();
  ptt.onpointerdown = down;
  ptt.onpointerup = up;
  ptt.onpointerleave = up;
  // Space talks wherever the focus is, unless a field takes typing (a focused button must not be
  // pressed by it: Drop network pressed again on every Space)
  const typing = (t) => (t instanceof HTMLInputElement && !['checkbox', 'file', 'button'].includes(t.type)) || t instanceof HTMLTextAreaElement || t instanceof HTMLSelectElement;
  document.addEventListener('keydown', (e) => {
    if (e.code !== 'Space' || typing(e.target)) return;
    e.preventDefault();
    if (!e.repeat && !ptt.disabled) down();
  });
  document.addEventListener('keyup', (e) => {
    if (e.code !== 'Space' || typing(e.target)) return;
    e.preventDefault();
    up();
  });
  if (params.get('autoconnect') === '1') start(info);
}

main();
