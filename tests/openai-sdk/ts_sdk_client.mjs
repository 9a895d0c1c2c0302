// The official `openai` TypeScript SDK's realtime client for Node (`OpenAIRealtimeWS`, over the
// `ws` package) against antiphon's OpenAI Realtime dialect, configured only by `baseURL`. The SDK
// always dials `wss://`, so the server runs with TLS; the test trusts its certificate by `ca`.
// It does a text turn and an audio turn, and checks every event the SDK emits has the fields the
// SDK's types declare for it (event_id, and the ids of the response, item and part).
//
//   node tests/openai-sdk/ts_sdk_client.mjs https://127.0.0.1:8443/openai/v1 /path/to/cert.pem
import fs from 'node:fs';
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';

const [base, certPath] = process.argv.slice(2);
if (!base || !certPath) {
  console.error('usage: ts_sdk_client.mjs BASE_URL CERT_PEM');
  process.exit(2);
}

function fail(msg) {
  console.error('FAIL:', msg);
  process.exit(1);
}

const client = new OpenAI({ apiKey: process.env.ANTIPHON_KEY || 'sk-antiphon-test', baseURL: base });
const rt = new OpenAIRealtimeWS({ model: 'gpt-realtime', options: { ca: fs.readFileSync(certPath) } }, client);
if (!rt.url.toString().startsWith('wss://')) fail(`the SDK dialled ${rt.url}`);

let closing = false;
const queue = [];
let waiter = null;
rt.on('event', (e) => {
  if (typeof e.event_id !== 'string' || !e.event_id) fail(`an event without event_id: ${JSON.stringify(e)}`);
  if (e.type.startsWith('response.output_') || e.type.startsWith('response.content_part')) {
    for (const k of ['response_id', 'output_index']) if (e[k] === undefined) fail(`${e.type} without ${k}`);
  }
  queue.push(e);
  if (waiter) {
    const w = waiter;
    waiter = null;
    w();
  }
});
rt.on('error', (err) => fail(`the SDK reported an error: ${err.message} ${JSON.stringify(err.error ?? {})}`));
rt.socket.on('close', (code) => {
  if (!closing) fail(`the socket closed (${code})`);
});

async function next(timeoutMs = 120000) {
  const deadline = Date.now() + timeoutMs;
  while (queue.length === 0) {
    if (Date.now() > deadline) fail('no event in time');
    await new Promise((resolve) => {
      waiter = resolve;
      setTimeout(resolve, 1000);
    });
  }
  return queue.shift();
}

async function until(type, seen = []) {
  for (;;) {
    const e = await next();
    seen.push(e);
    if (e.type === type) return e;
  }
}

function audioBytes(events) {
  return events.filter((e) => e.type === 'response.output_audio.delta').reduce((n, e) => n + Buffer.from(e.delta, 'base64').length, 0);
}

const created = await until('session.created');
if (created.session.type !== 'realtime') fail(`session.created: ${JSON.stringify(created.session)}`);
rt.send({ type: 'session.update', session: { type: 'realtime', instructions: 'Be brief.', audio: { input: { turn_detection: null } } } });
const updated = await until('session.updated');
if (updated.session.instructions !== 'Be brief.') fail('instructions not echoed');

// a text turn
rt.send({ type: 'conversation.item.create', item: { type: 'message', role: 'user', content: [{ type: 'input_text', text: 'Hello' }] } });
await until('conversation.item.done');
rt.send({ type: 'response.create' });
let evs = [];
let done = await until('response.done', evs);
const transcript = evs.filter((e) => e.type === 'response.output_audio_transcript.delta').map((e) => e.delta).join('');
if (done.response.status !== 'completed') fail(`text turn: ${done.response.status}`);
if (audioBytes(evs) === 0) fail('text turn: no audio');
if (!transcript) fail('text turn: no transcript');
console.log(`text turn: ${audioBytes(evs) / 48} ms of audio, transcript ${JSON.stringify(transcript.slice(0, 40))}`);

// an audio turn: one second of a 200 Hz square wave, appended in 200 ms pieces, committed
const pcm = Buffer.alloc(48000);
for (let i = 0; i < 24000; i++) pcm.writeInt16LE(Math.floor(i / 60) % 2 ? 8000 : -8000, 2 * i);
for (let i = 0; i < pcm.length; i += 9600) rt.send({ type: 'input_audio_buffer.append', audio: pcm.subarray(i, i + 9600).toString('base64') });
rt.send({ type: 'input_audio_buffer.commit' });
const committed = await until('input_audio_buffer.committed');
rt.send({ type: 'response.create' });
evs = [];
done = await until('response.done', evs);
if (done.response.status !== 'completed') fail(`audio turn: ${done.response.status}`);
if (audioBytes(evs) === 0) fail('audio turn: no audio');
console.log(`audio turn: item ${committed.item_id}, ${audioBytes(evs) / 48} ms of audio`);

closing = true;
rt.close();
console.log('openai TypeScript SDK client: all checks passed');
