// vLLM-Omni's realtime video dialect (WS /v1/realtime/video, PROTOCOL.md) played through Media Source Extensions.
//
// The server sends video.chunk_metadata then one binary of fragmented MP4 per chunk; the first binary opens
// with the init segment. Appended in order to one SourceBuffer they play as a live stream. Keys W A S D and
// the arrows send camera velocities as vLLM-Omni's own helper builds them (structural SE3, Unity axes:
// +X right, +Z forward; yaw about +Y), which the server maps onto the model's keys and camera.

const STEP = 0.05; // translation per frame for a held key (vLLM-Omni's WASD helper)
const YAW_DEGREES = 6; // turn per frame for a held look key (the same helper)
const MOVES = { w: [0, 1], s: [0, -1], a: [-1, 0], d: [1, 0] }; // key -> [x, z]
const LOOKS = { ArrowLeft: -1, ArrowRight: 1 }; // key -> yaw sign
const LIVE_LAG_S = 0.5; // a playhead further behind the newest frame than this jumps ahead

/** The structural SE3 camera payload (mode velocity) for the held keys. */
export function cameraPayload(held) {
  let x = 0;
  let z = 0;
  let yaw = 0;
  for (const key of held) {
    if (MOVES[key]) {
      x += MOVES[key][0];
      z += MOVES[key][1];
    }
    if (LOOKS[key]) yaw += LOOKS[key];
  }
  const half = (yaw * YAW_DEGREES * Math.PI) / 360;
  return {
    mode: 'velocity',
    data: { translation: [Math.sign(x) * STEP, 0, Math.sign(z) * STEP], rotation: [0, Math.sin(half), 0, Math.cos(half)] },
  };
}

/** The MSE type of a stream from its init segment's avcC (profile, compatibility, level). */
export function mimeType(initSegment) {
  const bytes = new Uint8Array(initSegment);
  for (let i = 0; i + 7 < bytes.length; i++) {
    if (bytes[i] === 0x61 && bytes[i + 1] === 0x76 && bytes[i + 2] === 0x63 && bytes[i + 3] === 0x43) {
      const hex = [bytes[i + 5], bytes[i + 6], bytes[i + 7]].map((b) => b.toString(16).padStart(2, '0')).join('');
      return `video/mp4; codecs="avc1.${hex.toUpperCase()}"`;
    }
  }
  throw new Error('the first binary has no avcC box: not an fMP4 init segment');
}

/** One session of the dialect into a <video> element; `onEvent` sees every JSON event the server sends. */
export class RealtimeVideoPlayer {
  constructor(video, { onEvent = () => {} } = {}) {
    this.video = video;
    this.onEvent = onEvent;
    this.chunks = 0;
    this.bytes = 0;
    this.queue = [];
    this.sourceBuffer = null;
    this.events = 0;
    this.done = null;
  }

  /** Open the socket and send session.start; resolves with video.start, or rejects with the error event. */
  start(url, startMessage) {
    this.mediaSource = new MediaSource();
    this.video.src = URL.createObjectURL(this.mediaSource);
    const opened = new Promise((resolve) => this.mediaSource.addEventListener('sourceopen', resolve, { once: true }));
    this.ws = new WebSocket(url);
    this.ws.binaryType = 'arraybuffer';
    this.done = new Promise((resolve) => { this.ws.addEventListener('close', () => resolve(), { once: true }); });
    return new Promise((resolve, reject) => {
      this.ws.onopen = () => this.ws.send(JSON.stringify({ type: 'session.start', ...startMessage }));
      this.ws.onmessage = async (message) => {
        if (typeof message.data === 'string') {
          const event = JSON.parse(message.data);
          this.onEvent(event);
          if (event.type === 'video.start') resolve(event);
          if (event.type === 'error' && !this.chunks) reject(new Error(event.message));
          if (event.type === 'session.done' && this.mediaSource.readyState === 'open') this.finish();
          return;
        }
        await opened;
        this.append(message.data);
      };
      this.ws.onerror = () => reject(new Error('the WebSocket failed'));
    });
  }

  append(buffer) {
    if (!this.sourceBuffer) {
      this.sourceBuffer = this.mediaSource.addSourceBuffer(mimeType(buffer));
      this.sourceBuffer.mode = 'sequence';
      this.sourceBuffer.addEventListener('updateend', () => this.pump());
    }
    this.chunks += 1;
    this.bytes += buffer.byteLength;
    this.queue.push(buffer);
    this.pump();
  }

  pump() {
    if (!this.sourceBuffer || this.sourceBuffer.updating) return;
    if (this.queue.length) {
      this.sourceBuffer.appendBuffer(this.queue.shift());
      return;
    }
    if (this.ending && this.mediaSource.readyState === 'open') this.mediaSource.endOfStream();
    const buffered = this.video.buffered;
    if (buffered.length) {
      const newest = buffered.end(buffered.length - 1);
      if (newest - this.video.currentTime > LIVE_LAG_S) this.video.currentTime = Math.max(0, newest - 0.1);
      if (this.video.paused) this.video.play().catch(() => {});
    }
  }

  finish() {
    this.ending = true;
    this.pump();
  }

  /** Send a session.interaction (its event: prompt and/or multi_modal_data). */
  interact(event, eventId) {
    this.events += 1;
    const interaction = { event_id: eventId || `page-${this.events}`, event };
    this.ws.send(JSON.stringify({ type: 'session.interaction', interaction }));
  }

  stop() {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify({ type: 'session.stop' }));
  }
}
