// AudioWorklet processors of the demo page.
//
// `capture`: posts the microphone as 20 ms Float32 frames (mono) to the page.
// `player`: a jitter buffer the page pushes decoded samples into; it plays them in order and
// reports how many it played, how deep the buffer is, stalls (the buffer ran dry while a
// response was still arriving) and the output's level (RMS since the last report).

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.frame = new Float32Array(Math.round(sampleRate / 50));
    this.fill = 0;
  }

  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (!ch) return true;
    let i = 0;
    while (i < ch.length) {
      const n = Math.min(ch.length - i, this.frame.length - this.fill);
      this.frame.set(ch.subarray(i, i + n), this.fill);
      this.fill += n;
      i += n;
      if (this.fill === this.frame.length) {
        this.port.postMessage(this.frame.slice());
        this.fill = 0;
      }
    }
    return true;
  }
}

class Player extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];
    this.offset = 0;
    this.depth = 0; // samples queued
    this.played = 0; // samples played, all responses
    this.streaming = false; // a response is arriving: running dry now is a stall
    this.dry = false;
    this.stalls = 0;
    this.stallSamples = 0;
    this.ticks = 0;
    this.energy = 0; // sum of squares since the last report
    this.counted = 0;
    this.port.onmessage = (e) => {
      const m = e.data;
      if (m.type === 'push') {
        this.queue.push(m.samples);
        this.depth += m.samples.length;
        this.streaming = true;
      } else if (m.type === 'end') {
        this.streaming = false; // the response's last packet is in the queue
      } else if (m.type === 'flush') {
        this.queue = [];
        this.offset = 0;
        this.depth = 0;
        this.streaming = false;
        this.report(); // the page sees the empty queue now, not up to 8 quanta later
      }
    };
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    let i = 0;
    while (i < out.length && this.queue.length) {
      const head = this.queue[0];
      const n = Math.min(out.length - i, head.length - this.offset);
      out.set(head.subarray(this.offset, this.offset + n), i);
      i += n;
      this.offset += n;
      this.depth -= n;
      this.played += n;
      if (this.offset >= head.length) {
        this.queue.shift();
        this.offset = 0;
      }
    }
    if (i < out.length) {
      out.fill(0, i);
      if (this.streaming) {
        if (!this.dry) this.stalls++;
        this.dry = true;
        this.stallSamples += out.length - i;
      }
    } else {
      this.dry = false;
    }
    for (const s of out) this.energy += s * s;
    this.counted += out.length;
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (++this.ticks % 8 === 0) this.report();
    return true;
  }

  report() {
    const level = this.counted ? Math.sqrt(this.energy / this.counted) : 0;
    this.energy = 0;
    this.counted = 0;
    this.port.postMessage({ played: this.played, depth: this.depth, stalls: this.stalls, stallMs: (this.stallSamples / sampleRate) * 1000, level });
  }
}

registerProcessor('capture', Capture);
registerProcessor('player', Player);
