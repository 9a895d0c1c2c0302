#!/usr/bin/env python3
"""pipecat's OpenAI Realtime service (`OpenAIRealtimeLLMService`, pipecat-ai from PyPI) against
antiphon's OpenAI Realtime dialect, configured only by `base_url`. A pipeline of the service and a
frame collector:

1. a text turn: an LLM context with one user message; the service creates the response, and the
   pipeline sees TTSStartedFrame, TTSAudioRawFrame (24 kHz PCM), TTSStoppedFrame and
   LLMFullResponseEndFrame;
2. a spoken turn with the server's turn detection (pipecat's default: it sends no
   turn_detection and never commits): an espeak-ng phrase and a second of silence streamed as
   20 ms input audio frames; the server detects the turn and answers by itself, with audio; with
   input transcription set in the session, the caller's words come back as pipecat's
   TranscriptionFrame (what its user context aggregator waits for).

No error may appear (pipecat ends its receive loop on any error but the two benign codes). pipecat
pushes its ErrorFrames upstream, so a collector after the service never sees them: the service's
`on_error` handler is where they are caught.

    python3 tests/client/pipecat_client.py ws://127.0.0.1:8080/openai/v1/realtime
"""
import argparse
import asyncio
import os
import struct
import sys
import wave

import pipecat.services.openai.realtime.events as rt_events
from pipecat.frames.frames import (
    ErrorFrame,
    TranscriptionFrame,
    InputAudioRawFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


class Collector(FrameProcessor):
    def __init__(self):
        super().__init__()
        self.kinds = []
        self.audio_bytes = 0
        self.rates = set()
        self.ends = 0
        self.changed = asyncio.Event()

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, ErrorFrame):
            fail(f"pipecat reported an error: {frame.error}")
        if isinstance(frame, (TTSStartedFrame, TTSStoppedFrame, LLMFullResponseEndFrame)):
            self.kinds.append(type(frame).__name__)
        if isinstance(frame, TTSAudioRawFrame):
            if not self.kinds or self.kinds[-1] != "TTSAudioRawFrame":
                self.kinds.append("TTSAudioRawFrame")
            self.audio_bytes += len(frame.audio)
            self.rates.add(frame.sample_rate)
        if isinstance(frame, LLMFullResponseEndFrame):
            self.ends += 1
            self.changed.set()
        await self.push_frame(frame, direction)

    async def wait_ends(self, n, timeout=180):
        async def wait():
            while self.ends < n:
                self.changed.clear()
                await self.changed.wait()
        try:
            await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            fail(f"no response end {n} within {timeout} s; frames so far: {self.kinds}")


class Heard(FrameProcessor):
    """Before the service: the transcripts it pushes upstream."""

    def __init__(self):
        super().__init__()
        self.transcripts = []
        self.changed = asyncio.Event()

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            self.transcripts.append(frame.text)
            self.changed.set()
        await self.push_frame(frame, direction)


def phrase_24k(name):
    w = wave.open(os.path.join(ROOT, "assets", "vad", name))
    rate, n = w.getframerate(), w.getnframes()
    x = struct.unpack(f"<{n}h", w.readframes(n))
    m = n * 24000 // rate
    out = []
    for i in range(m):
        t = i * rate / 24000
        j = int(t)
        a, b = x[min(j, n - 1)], x[min(j + 1, n - 1)]
        out.append(int(a + (b - a) * (t - j)))
    return out


async def main(url):
    transcribed = rt_events.SessionProperties(audio=rt_events.AudioConfiguration(
        input=rt_events.AudioInput(transcription=rt_events.InputAudioTranscription(model="gpt-4o-transcribe"))))
    llm = OpenAIRealtimeLLMService(api_key=os.environ.get("ANTIPHON_KEY", "sk-antiphon-test"), base_url=url,
                                   settings=OpenAIRealtimeLLMService.Settings(session_properties=transcribed))
    collector = Collector()

    @llm.event_handler("on_error")
    async def on_error(processor, error):
        fail(f"pipecat reported an error: {error.error}")

    heard = Heard()
    worker = PipelineWorker(Pipeline([heard, llm, collector]), idle_timeout_secs=None, enable_rtvi=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())

    # 1. a text turn
    await worker.queue_frame(LLMContextFrame(LLMContext(messages=[{"role": "user", "content": "Hello, how are you?"}])))
    await collector.wait_ends(1)
    first = list(collector.kinds)
    want = ["TTSStartedFrame", "TTSAudioRawFrame", "TTSStoppedFrame", "LLMFullResponseEndFrame"]
    if first != want:
        fail(f"text turn frames {first}, expected {want}")
    if collector.audio_bytes == 0 or collector.rates != {24000}:
        fail(f"text turn audio: {collector.audio_bytes} bytes at {collector.rates}")
    print(f"text turn: {collector.audio_bytes // 48} ms of audio at 24 kHz; frames {first}")

    # 2. a spoken turn, detected by the server
    before = collector.audio_bytes
    x = [0] * 12000 + phrase_24k("phrase1.wav") + [0] * 24000
    for i in range(0, len(x), 480):
        piece = x[i:i + 480]
        await worker.queue_frame(InputAudioRawFrame(audio=struct.pack(f"<{len(piece)}h", *piece), sample_rate=24000, num_channels=1))
    await collector.wait_ends(2)
    if collector.audio_bytes <= before:
        fail("the spoken turn got no audio")
    try:
        await asyncio.wait_for(heard.changed.wait(), 60)
    except asyncio.TimeoutError:
        fail("no TranscriptionFrame for the spoken turn within 60 s")
    if len(heard.transcripts) != 1 or not heard.transcripts[0]:
        fail(f"transcripts {heard.transcripts}")
    print(f"spoken turn (server VAD): {(collector.audio_bytes - before) // 48} ms of audio; frames {collector.kinds[len(first):]}; "
          f"transcribed ({len(heard.transcripts[0])} characters)")

    await worker.cancel()
    await run
    print("pipecat client: all checks passed")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url", help="the dialect's WebSocket URL, e.g. ws://127.0.0.1:8080/openai/v1/realtime")
    asyncio.run(main(p.parse_args().url))
