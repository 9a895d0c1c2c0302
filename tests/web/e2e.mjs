// End-to-end tests of the browser demo (web/) in headless Chromium, against a running server.
//
//   node tests/web/e2e.mjs [http://127.0.0.1:8080]
//
// Chromium's fake microphone plays assets/voices/default.wav. The page is loaded through a small
// TCP proxy of this script's own, which can cut every live connection: the page must reconnect,
// resume its session, and end up with every server message exactly once (no gap, no replay
// played twice). Screenshots go to $E2E_ARTIFACTS (default target/e2e-artifacts).
import { chromium } from 'playwright-core';
import net from 'node:net';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const target = new URL(process.argv[2] || 'http://127.0.0.1:8080');
const artifacts = path.resolve(repo, process.env.E2E_ARTIFACTS || 'target/e2e-artifacts');
const wav = path.join(repo, 'assets/voices/default.wav');
fs.mkdirSync(artifacts, { recursive: true });

/** A TCP proxy to the server that can cut every connection it carries. */
class CuttingProxy {
  constructor(host, port) {
    this.sockets = new Set();
    this.connections = 0;
    this.server = net.createServer((client) => {
      this.connections++;
      const upstream = net.connect(port, host);
      for (const s of [client, upstream]) {
        this.sockets.add(s);
        s.on('close', () => this.sockets.delete(s));
        s.on('error', () => {});
      }
      client.pipe(upstream);
      upstream.pipe(client);
      client.on('close', () => upstream.destroy());
      upstream.on('close', () => client.destroy());
    });
  }
  listen() {
    return new Promise((ok) => this.server.listen(0, '127.0.0.1', () => ok(this.server.address().port)));
  }
  /** Drops every live connection at once (no close handshake: like a network drop). */
  cut() {
    const n = this.sockets.size;
    for (const s of this.sockets) s.resetAndDestroy ? s.resetAndDestroy() : s.destroy();
    return n;
  }
  close() {
    this.cut();
    this.server.close();
  }
}

const results = [];
let failed = 0;
async function test(name, fn) {
  const t0 = Date.now();
  try {
    await fn();
    results.push(`ok    ${name} (${((Date.now() - t0) / 1000).toFixed(1)} s)`);
  } catch (e) {
    failed++;
    results.push(`FAIL  ${name}: ${e.stack || e}`);
  }
  console.log(results[results.length - 1]);
}

function assert(cond, msg) {
  if (!cond) throw new Error('assertion failed: ' + msg);
}

const stats = (page) => page.evaluate(() => JSON.parse(JSON.stringify(window.antiphon.stats)));

/** Every server seq from 1 to the highest, each exactly once, in order. */
function assertGapless(seqs) {
  for (let i = 0; i < seqs.length; i++) {
    assert(seqs[i] === i + 1, `server seqs are gapless and unique: position ${i} holds ${seqs[i]} (${seqs.slice(Math.max(0, i - 3), i + 3)})`);
  }
}

const proxy = new CuttingProxy(target.hostname, Number(target.port || 80));
const port = await proxy.listen();
const base = `http://127.0.0.1:${port}`;
const chromeArgs = (mic) => [
  '--no-sandbox',
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--autoplay-policy=no-user-gesture-required',
  '--use-fake-ui-for-media-stream',
  '--use-fake-device-for-media-stream',
  `--use-file-for-fake-audio-capture=${mic}`,
];
const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium', headless: true, args: chromeArgs(wav) });

async function openPage(query) {
  const page = await browser.newPage();
  page.on('pageerror', (e) => console.log('page error:', e.message));
  page.on('console', (m) => m.type() === 'error' && console.log('page console:', m.text()));
  await page.goto(`${base}/?${query}`);
  await page.waitForFunction(() => window.antiphon && document.getElementById('voice').options.length > 0, null, { timeout: 15000 });
  return page;
}

/** Ends the page's session (Hang up, where it is connected) and closes the page: the server holds
 *  only a few sessions, parked ones included. */
async function end(page) {
  if (!(await page.isDisabled('#hangup'))) await page.click('#hangup');
  await page.close();
}

async function connect(page, mode = 'turn') {
  await page.selectOption('#mode', mode);
  await page.click('#connect');
  await page.waitForFunction(() => window.antiphon.stats.state === 'connected', null, { timeout: 30000 });
}

/** Waits until the response is done and its audio has played out. */
async function waitPlayed(page, id, timeout = 90000) {
  await page.waitForFunction(
    (id) => {
      const s = window.antiphon.stats;
      const r = s.responses[id];
      return r && r.status && r.packets >= r.donePackets && s.depthMs === 0;
    },
    id,
    { timeout },
  );
  await page.waitForTimeout(300);
}

await test('speaks through the fake microphone, hears the answer, shows its TTFA', async () => {
  const page = await openPage('text_tokens=8&audio_tokens=50');
  const note = await page.textContent('#note');
  assert(/synthetic weights/.test(note), `the page says the weights are synthetic: "${note}"`);
  await connect(page);
  // hold to talk for 1.5 s of the fake microphone, then let go (input.commit)
  await page.dispatchEvent('#ptt', 'pointerdown');
  await page.waitForTimeout(1500);
  await page.dispatchEvent('#ptt', 'pointerup');
  await page.waitForFunction(() => window.antiphon.stats.ttfa.length > 0, null, { timeout: 60000 });
  const id = Number(Object.keys((await stats(page)).responses)[0]);
  await waitPlayed(page, id);
  const s = await stats(page);
  const r = s.responses[id];
  await page.screenshot({ path: path.join(artifacts, '1-turn.png'), fullPage: true });
  assert(s.sentPackets >= 50, `sent ~75 mic packets of 20 ms (${s.sentPackets}, codec ${s.codecIn})`);
  assert(r.status === 'completed', `response completed (${r.status})`);
  assert(r.packets === r.donePackets && r.packets > 0, `every audio packet arrived: ${r.packets} of ${r.donePackets}`);
  assert(s.playedSamples > 0, 'the playback worklet played samples');
  const playedMs = (s.playedSamples / 48000) * 1000;
  assert(Math.abs(playedMs - r.packets * 20) <= 60, `played ${playedMs.toFixed(0)} ms for ${r.packets} packets of 20 ms`);
  assert(/^\d+ ms$/.test(await page.textContent('#ttfa')), 'the TTFA is on the page');
  assertGapless(s.seqs);
  // the conversation with both sides, who is doing what, the levels and the TTFA per turn
  const lines = await page.$$eval('#conversation li', (ls) => ls.map((l) => `${l.className}: ${l.lastChild.textContent}`));
  assert(lines.length === 2 && /^you: you said 1\.\d s of audio/.test(lines[0]) && /^assistant: .+/.test(lines[1]), `the conversation: ${JSON.stringify(lines)}`);
  for (const a of ['listening', 'thinking', 'speaking']) assert(s.activity.includes(a), `the page showed "${a}" (${s.activity.join(' → ')})`);
  assert(s.outPeak > 0, "the assistant's level meter moved");
  assert((await page.$$('#ttfaplot circle')).length === 1, 'the TTFA plot holds the turn');
  await page.fill('#text', 'And once more.');
  await page.press('#text', 'Enter');
  await page.waitForFunction(() => window.antiphon.stats.ttfa.length === 2, null, { timeout: 60000 });
  const typed = await page.$$eval('#conversation li.you', (ls) => ls.map((l) => l.lastChild.textContent));
  assert(typed[1] === 'And once more.', `the typed turn is in the conversation: ${JSON.stringify(typed)}`);
  assert((await page.$$('#ttfaplot circle')).length === 2, 'the TTFA plot holds both turns');
  await page.screenshot({ path: path.join(artifacts, '1-conversation.png'), fullPage: true });
  console.log(`      codecs in/out ${s.codecIn}/${s.codecOut}, TTFA ${s.ttfa[0]} ms, played ${playedMs.toFixed(0)} ms, stalls ${s.stalls}; activity ${s.activity.join(' → ')}`);
  await end(page);
});

await test('a network drop mid-response: the page resumes with nothing lost and nothing played twice', async () => {
  const page = await openPage('text_tokens=8&audio_tokens=200');
  await connect(page);
  const before = proxy.connections;
  await page.fill('#text', 'Please read this sentence aloud: the festival starts after the parade.');
  await page.press('#text', 'Enter');
  await page.waitForFunction(() => window.antiphon.stats.audioPackets >= 15, null, { timeout: 60000 });
  const cut = proxy.cut();
  await page.waitForFunction(() => window.antiphon.stats.state !== 'connected', null, { timeout: 10000 });
  await page.screenshot({ path: path.join(artifacts, '2-dropped.png'), fullPage: true });
  await page.waitForFunction(() => window.antiphon.stats.state === 'connected', null, { timeout: 30000 });
  const id = Number(Object.keys((await stats(page)).responses)[0]);
  await waitPlayed(page, id);
  const s = await stats(page);
  const r = s.responses[id];
  await page.screenshot({ path: path.join(artifacts, '3-resumed.png'), fullPage: true });
  assert(cut >= 2, `the proxy cut a live connection (${cut} sockets)`);
  assert(proxy.connections > before && s.reconnects >= 1, `the page reconnected (${s.reconnects})`);
  assert(r.status === 'completed', `the response completed after the resume (${r.status})`);
  assert(r.packets === r.donePackets, `no packet lost: ${r.packets} received of ${r.donePackets}`);
  assert(new Set(s.audioSeqs).size === s.audioSeqs.length, 'no audio packet twice');
  assertGapless(s.seqs);
  const playedMs = (s.playedSamples / 48000) * 1000;
  assert(Math.abs(playedMs - r.packets * 20) <= 60, `played ${playedMs.toFixed(0)} ms for ${r.packets} packets: nothing skipped or repeated`);
  console.log(`      cut ${cut} sockets after ${s.audioSeqs.length ? 15 : 0}+ packets; ${s.reconnects} reconnect(s), ${s.duplicates} replays dropped, ${r.packets} packets, played ${playedMs.toFixed(0)} ms`);
  await end(page);
});

await test('a resume the server refuses: the page starts a new session on the same socket and goes on', async () => {
  const page = await openPage('text_tokens=8&audio_tokens=30');
  await connect(page);
  const first = await page.evaluate(() => window.antiphon.client().session.id);
  // the page's resume token goes bad, then the network drops: its resume gets bad_resume_token
  await page.evaluate(() => (window.antiphon.client().session.token = 'not-the-token'));
  proxy.cut();
  await page.waitForFunction((first) => {
    const c = window.antiphon.client();
    return window.antiphon.stats.state === 'connected' && c.session && c.session.id !== first;
  }, first, { timeout: 30000 });
  assert((await stats(page)).events.some((e) => /bad_resume_token/.test(e)), 'the refusal was shown');
  await page.fill('#text', 'Still there?');
  await page.press('#text', 'Enter');
  await page.waitForFunction(() => Object.values(window.antiphon.stats.responses).some((r) => r.status === 'completed'), null, { timeout: 60000 });
  console.log(`      session ${first} could not be resumed; the page went on in a new one`);
  await end(page);
});

await test('input spoken during a drop is kept and resent after the resume', async () => {
  const page = await openPage('text_tokens=8&audio_tokens=50');
  await connect(page);
  await page.dispatchEvent('#ptt', 'pointerdown');
  await page.waitForTimeout(500);
  proxy.cut();
  await page.waitForTimeout(700); // still talking while the network is down
  await page.waitForFunction(() => window.antiphon.stats.state === 'connected', null, { timeout: 30000 });
  await page.waitForTimeout(300);
  await page.dispatchEvent('#ptt', 'pointerup');
  await page.waitForFunction(() => Object.values(window.antiphon.stats.responses).some((r) => r.status), null, { timeout: 60000 });
  await page.waitForFunction(() => window.antiphon.stats.unapplied === 0, null, { timeout: 10000 });
  const s = await stats(page);
  const r = Object.values(s.responses)[0];
  assert(s.resumes.length >= 1, 'the page resumed');
  const { applied, sent } = s.resumes[0];
  assert(applied < sent, `input was waiting at the resume (server had ${applied} of ${sent}) and was resent`);
  assert(r.status === 'completed' && r.packets === r.donePackets, `the spoken turn was answered in full (${r.status}, ${r.packets}/${r.donePackets})`);
  assertGapless(s.seqs);
  console.log(`      resume: server had applied ${applied} of ${sent} inputs; ${s.sentPackets} packets sent in all, all applied`);
  await end(page);
});

await test('PCM16 both ways (no WebCodecs) and an uploaded reference voice, registered', async () => {
  const page = await openPage('pcm=1&text_tokens=8&audio_tokens=50');
  await page.setInputFiles('#ref', wav);
  await page.check('#keep');
  await connect(page);
  await page.fill('#text', 'Please read this sentence aloud: the festival starts after the parade.');
  await page.press('#text', 'Enter');
  await page.waitForFunction(() => Object.values(window.antiphon.stats.responses).some((r) => r.status), null, { timeout: 60000 });
  const id = Number(Object.keys((await stats(page)).responses)[0]);
  await waitPlayed(page, id);
  const s = await stats(page);
  const r = s.responses[id];
  assert(s.codecIn === 'pcm16' && s.codecOut === 'pcm16', `PCM16 in and out (${s.codecIn}/${s.codecOut})`);
  assert(s.events.some((e) => /reference voice: default\.wav, 6\.0 s registered as v_/.test(e)), 'the uploaded voice was registered');
  assert((await page.$eval('#voice', (el) => el.value)).startsWith('v_'), 'and is picked by its id');
  assert(!s.events.some((e) => /error/.test(e)), `no error: ${s.events.filter((e) => /error/.test(e))}`);
  assert(r.status === 'completed' && r.packets === r.donePackets, `answered in the uploaded voice (${r.status})`);
  const playedMs = (s.playedSamples / 48000) * 1000;
  assert(Math.abs(playedMs - r.audioMs) <= 60, `played ${playedMs.toFixed(0)} ms of ${r.audioMs} ms`);
  // another visitor (another browser profile) is not shown it, though the server holds it
  const kept = await page.$eval('#voice', (el) => el.value);
  const other = await openPage('text_tokens=8&audio_tokens=30');
  const listed = await other.evaluate(async () => (await (await fetch('/v1/voices')).json()).voices.map((v) => v.id));
  const offered = await other.$$eval('#voice option', (os) => os.map((o) => o.value));
  assert(listed.includes(kept) && !offered.includes(kept), `${kept} is on the server (${listed}) but not offered to another visitor (${offered})`);
  await other.close();
  await end(page);
});

await test('an uploaded voice goes with this call only unless it is kept', async () => {
  const page = await openPage('text_tokens=8&audio_tokens=30');
  const before = await page.evaluate(async () => (await (await fetch('/v1/voices')).json()).voices.length);
  await page.setInputFiles('#ref', wav);
  await connect(page);
  await page.fill('#text', 'In my voice, please.');
  await page.press('#text', 'Enter');
  await page.waitForFunction(() => Object.values(window.antiphon.stats.responses).some((r) => r.status === 'completed'), null, { timeout: 60000 });
  const s = await stats(page);
  const after = await page.evaluate(async () => (await (await fetch('/v1/voices')).json()).voices.length);
  assert(s.events.some((e) => /reference voice: default\.wav, 6\.0 s for this call only \(not kept\)/.test(e)), 'the page says the voice is not kept');
  assert(after === before, `nothing was registered (${before} voices before, ${after} after)`);
  await end(page);
});

await test('barge-in: talking over the answer cancels it and reports what was heard', async () => {
  const page = await openPage('text_tokens=8&audio_tokens=250');
  await connect(page);
  await page.fill('#text', 'Please read this sentence aloud: we shared bread, cheese and ripe pears.');
  await page.press('#text', 'Enter');
  // wait until the answer is audibly playing, then press to talk over it
  await page.waitForFunction(() => window.antiphon.stats.playedSamples > 48000 * 0.5, null, { timeout: 60000 });
  await page.dispatchEvent('#ptt', 'pointerdown');
  const id = Number(Object.keys((await stats(page)).responses)[0]);
  await page.waitForFunction((id) => window.antiphon.stats.responses[id].status !== null, id, { timeout: 30000 });
  await page.dispatchEvent('#ptt', 'pointerup');
  const s = await stats(page);
  const r = s.responses[id];
  await page.screenshot({ path: path.join(artifacts, '4-barge-in.png'), fullPage: true });
  assert(r.status === 'cancelled', `the answer was cancelled (${r.status})`);
  assert(r.donePackets < 250 * 2, `it stopped early: ${r.donePackets} packets of a 10 s answer`);
  assert(s.events.some((e) => /barge-in: response \d+ cancelled after \d+ ms heard/.test(e)), 'the page told the server what was heard');
  assert(s.depthMs < 100, `the queued answer was dropped (${s.depthMs} ms left)`);
  await end(page);
});

await test('duplex: audio streams both ways, listen/speak decisions and a spoken turn', async () => {
  const page = await openPage('text_tokens=4&speak_every=2');
  await connect(page, 'duplex');
  await page.waitForFunction(() => Object.values(window.antiphon.stats.responses).some((r) => r.status === 'completed'), null, { timeout: 60000 });
  const s = await stats(page);
  await page.screenshot({ path: path.join(artifacts, '5-duplex.png'), fullPage: true });
  const events = s.events.join('\n');
  assert(s.sentPackets >= 50, `the microphone streams continuously (${s.sentPackets} packets)`);
  assert(/\(duplex\)/.test(events), 'a response triggered by the model (duplex)');
  assert(/unit \d+: (listen|speak)/.test(await page.textContent('#duplex')), 'listen/speak decisions on the page');
  assert(s.playedSamples > 0, 'the answer played');
  assertGapless(s.seqs);
  // the session's settings are fixed while it runs, and duplex takes no typed turns
  for (const id of ['mode', 'voice', 'ref', 'text', 'send', 'ptt', 'connect']) assert(await page.isDisabled(`#${id}`), `#${id} is disabled in a duplex call`);
  // the reply's audio keeps pace with the units (issue 42: forced lengths drifted ~1 s a second)
  await page.waitForTimeout(6000);
  const later = await stats(page);
  assert(later.depthMs < 3000, `the playback buffer stays short (${later.depthMs} ms after ${(later.sentPackets / 50).toFixed(0)} s)`);
  console.log(`      buffer ${later.depthMs} ms after ${(later.sentPackets / 50).toFixed(0)} s of duplex`);
  await page.click('#hangup');
  for (const id of ['mode', 'voice', 'ref', 'connect']) assert(!(await page.isDisabled(`#${id}`)), `#${id} is enabled again after Hang up`);
  await end(page);
});

await test('Hang up, then Connect again: a new session answers', async () => {
  const page = await openPage('text_tokens=8&audio_tokens=30');
  await connect(page);
  const first = await page.evaluate(() => window.antiphon.client().session.id);
  await page.click('#hangup');
  await page.waitForFunction(() => window.antiphon.stats.state === 'idle', null, { timeout: 10000 });
  await connect(page);
  const second = await page.evaluate(() => window.antiphon.client().session.id);
  assert(second !== first, `a new session (${first} then ${second})`);
  await page.fill('#text', 'Hello again.');
  await page.press('#text', 'Enter');
  await page.waitForFunction(() => Object.values(window.antiphon.stats.responses).some((r) => r.status === 'completed'), null, { timeout: 60000 });
  // (each test ends its session: the server holds a few, parked ones included)
  await end(page);
});

await test('a file that is not audio: the page says why and connects with another voice', async () => {
  const page = await openPage('text_tokens=8&audio_tokens=30');
  await page.setInputFiles('#ref', { name: 'notes.wav', mimeType: 'audio/wav', buffer: Buffer.from('these are notes, not audio') });
  await page.click('#connect');
  await page.waitForFunction(() => window.antiphon.stats.state === 'error', null, { timeout: 15000 });
  const state = await page.textContent('#state');
  assert(/notes\.wav cannot be decoded as audio/.test(state), `the reason is on the page: "${state}"`);
  await page.screenshot({ path: path.join(artifacts, '7-bad-voice-file.png'), fullPage: true });
  assert(!(await page.isDisabled('#connect')), 'Connect works again');
  await connect(page);
  await end(page);
});

await test('Space talks wherever the focus is and never presses a focused button', async () => {
  const page = await openPage('text_tokens=8&audio_tokens=30');
  await connect(page);
  // Drop network keeps the focus after its click; the page resumes
  await page.click('#drop');
  await page.waitForFunction(() => window.antiphon.stats.state !== 'connected', null, { timeout: 10000 });
  await page.waitForFunction(() => window.antiphon.stats.state === 'connected', null, { timeout: 30000 });
  const drops = proxy.connections;
  await page.keyboard.down('Space');
  await page.waitForTimeout(1500);
  await page.keyboard.up('Space');
  await page.waitForFunction(() => Object.values(window.antiphon.stats.responses).some((r) => r.status === 'completed'), null, { timeout: 60000 });
  const s = await stats(page);
  assert(s.events.some((e) => /turn committed/.test(e)), 'Space made a spoken turn');
  assert(proxy.connections === drops && s.state === 'connected', `Space did not press Drop network again (${proxy.connections - drops} new connections)`);
  await end(page);
});


await test('hands-free: the level VAD starts the turn on speech and commits it after the pause', async () => {
  // a microphone that speaks for 1.5 s, then is quiet for 2.5 s (Chromium loops the file)
  const src = fs.readFileSync(wav);
  const speech = src.subarray(44, 44 + 16000 * 2 * 1.5);
  const pcm = Buffer.concat([speech, Buffer.alloc(16000 * 2 * 2.5)]);
  const header = Buffer.alloc(44);
  header.write('RIFF', 0);
  header.writeUInt32LE(36 + pcm.length, 4);
  header.write('WAVEfmt ', 8);
  header.writeUInt32LE(16, 16);
  header.writeUInt16LE(1, 20);
  header.writeUInt16LE(1, 22);
  header.writeUInt32LE(16000, 24);
  header.writeUInt32LE(32000, 28);
  header.writeUInt16LE(2, 32);
  header.writeUInt16LE(16, 34);
  header.write('data', 36);
  header.writeUInt32LE(pcm.length, 40);
  const file = path.join(artifacts, 'speech-then-pause.wav');
  fs.writeFileSync(file, Buffer.concat([header, pcm]));
  const b2 = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium', headless: true, args: chromeArgs(file) });
  try {
    const page = await b2.newPage();
    await page.goto(`${base}/?text_tokens=8&audio_tokens=50`);
    await page.waitForFunction(() => window.antiphon && document.getElementById('voice').options.length > 0, null, { timeout: 15000 });
    await page.check('#handsfree');
    const mark = await page.$eval('#threshold-mark', (m) => m.style.left);
    assert(mark === '16%', `the threshold (0.02, the meter's 16 %) is marked on the meter: ${mark}`);
    await connect(page);
    await page.waitForFunction(() => window.antiphon.stats.events.some((e) => /turn committed/.test(e)), null, { timeout: 30000 });
    await page.waitForFunction(() => Object.values(window.antiphon.stats.responses).some((r) => r.status === 'completed'), null, { timeout: 60000 });
    const s = await stats(page);
    await page.screenshot({ path: path.join(artifacts, '6-handsfree.png'), fullPage: true });
    const first = Number(/turn committed \((\d+) packets/.exec(s.events.find((e) => /turn committed/.test(e)))[1]);
    assert(first >= 50 && first <= 180, `the first turn holds the utterance, not the whole pause (${first} packets)`);
    assert(s.ttfa.length >= 1, 'the answer came');
  } finally {
    await b2.close();
  }
});

await browser.close();
proxy.close();
fs.writeFileSync(path.join(artifacts, 'results.txt'), results.join('\n') + '\n');
console.log(`${results.length - failed} passed, ${failed} failed; screenshots in ${artifacts}`);
process.exit(failed ? 1 : 0);
