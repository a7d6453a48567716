// The player: a jitter buffer of decoded frames drained onto the canvas at the
// model's fps, the canvas fitted to the screen, and the pacer that decides when
// the next tick should go out.

const MAX_SCALE_WHEN_FRACTIONAL = 2;  // under 2x a whole-number scale wastes too much screen
const LATENCY_SAMPLES = 16;           // recent chunk latencies the pacer reads
const STALL_FREE_FRAMES = 160;        // frames drawn without a stall before the buffer shrinks a step
const MARGIN_MS = 20;                 // decoding and one display refresh, on top of the expected latency

/**
 * How much playback the page keeps ahead of the screen.
 *
 * Adaptive (the default): enough to cover one chunk's latency (a high percentile
 * of recent ones) plus 20 ms; while chunks come back faster than they
 * play that is less than one chunk. Each stall adds a quarter of a chunk (up to
 * two chunks), and a long stall-free run takes a quarter off again. With
 * `fixedChunks` it keeps that many chunks ahead (the `?buffer=N` URL parameter).
 */
export class Pacer {
  constructor({ fps, framesPerChunk, fixedChunks = 0 }) {
    this.frameMs = 1000 / fps;
    this.chunkMs = this.frameMs * framesPerChunk;
    this.fixedChunks = fixedChunks;
    this.latencies = [];
    this.extraMs = 0;
    this.stalls = 0;
    this.sinceStall = 0;
  }

  /** A chunk's latency: its tick sent until its first frame arrived. */
  noteLatency(ms) {
    this.latencies.push(ms);
    if (this.latencies.length > LATENCY_SAMPLES) this.latencies.shift();
  }

  noteStall() {
    this.stalls += 1;
    this.sinceStall = 0;
    this.extraMs = Math.min(this.extraMs + this.chunkMs / 4, 2 * this.chunkMs);
  }

  noteDrawn() {
    this.sinceStall += 1;
    if (this.sinceStall >= STALL_FREE_FRAMES && this.extraMs > 0) {
      this.extraMs = Math.max(0, this.extraMs - this.chunkMs / 4);
      this.sinceStall = 0;
    }
  }

  /** Latency the page plans for: the 90th percentile of recent chunks, one chunk before any arrived. */
  expectedLatencyMs() {
    if (!this.latencies.length) return this.chunkMs;
    const sorted = [...this.latencies].sort((a, b) => a - b);
    return sorted[Math.min(sorted.length - 1, Math.floor(0.9 * sorted.length))];
  }

  /** Send another tick while the playback in hand (ms) is at most this. */
  targetLeadMs() {
    if (this.fixedChunks) return (this.fixedChunks - 1) * this.chunkMs;
    return this.expectedLatencyMs() + MARGIN_MS + this.extraMs;
  }
}

export class Player {
  /**
   * @param {HTMLCanvasElement} canvas
   * @param {{onDraw?: (entry: object, now: number) => void, onStall?: () => void}} hooks
   */
  constructor(canvas, hooks = {}) {
    this.canvas = canvas;
    this.ctx = canvas.getContext('2d');
    this.hooks = hooks;
    this.queue = [];       // entries in play order: {picture, broken, applied}
    this.frameMs = 1000 / 16;
    this.nextDrawAt = 0;
    this.playing = false;  // false while paused, stopped or before the first frame
    this.drawn = 0;
    this.dry = false;      // the buffer ran out while playing (counted once per dry spell)
  }

  /** Size the canvas for a model card; the old pictures stay until the first new frame. */
  configure(model) {
    this.frameMs = 1000 / model.fps;
    if (this.canvas.width !== model.width || this.canvas.height !== model.height) {
      this.canvas.width = model.width;
      this.canvas.height = model.height;
    }
  }

  /** Queue a frame whose picture is still decoding; it keeps its place until it resolves. */
  push(decoding, applied) {
    const entry = { picture: null, broken: false, applied };
    decoding.then(
      (picture) => { if (entry.dropped) picture.close(); else entry.picture = picture; },
      (error) => { entry.broken = true; entry.error = error; },
    );
    this.queue.push(entry);
    return entry;
  }

  /** Drop every queued frame (a new world, or the page stopped). */
  clear() {
    for (const entry of this.queue) {
      entry.dropped = true;
      if (entry.picture) entry.picture.close();
    }
    this.queue = [];
    this.dry = false;
  }

  /**
   * Milliseconds of playback in hand: queued frames plus `pendingFrames` (arriving
   * or asked for), counted from when the next frame is due.
   */
  leadMs(now, pendingFrames) {
    const from = Math.max(now, this.nextDrawAt);
    return from - now + (this.queue.length + pendingFrames) * this.frameMs;
  }

  /** Called every animation frame: draws the head of the queue when it is due. Returns true if it drew. */
  tick(now) {
    while (this.queue.length && this.queue[0].broken) this.queue.shift();  // skip frames that failed to decode
    const head = this.queue[0];
    if (!head || !head.picture) {
      // Running dry while playing is a stall (a frame is more than one interval late).
      if (this.playing && this.drawn > 0 && !this.dry && now > this.nextDrawAt + this.frameMs) {
        this.dry = true;
        if (this.hooks.onStall) this.hooks.onStall();
      }
      return false;
    }
    if (now < this.nextDrawAt) return false;
    this.queue.shift();
    this.dry = false;
    const { source } = head.picture;
    if (source instanceof ImageData) this.ctx.putImageData(source, 0, 0);
    else this.ctx.drawImage(source, 0, 0);
    head.picture.close();
    this.drawn += 1;
    // Stay on the fps grid, but after a stall start again from now instead of bursting.
    this.nextDrawAt = Math.max(this.nextDrawAt + this.frameMs, now - this.frameMs / 2);
    if (this.hooks.onDraw) this.hooks.onDraw(head, now);
    return true;
  }

  /**
   * Fit the canvas into a box of `width` x `height` CSS pixels: a whole-number
   * scale when it is at least 2x (every model pixel the same size), else the
   * largest fractional one. `image-rendering: pixelated` keeps edges crisp.
   */
  fit(width, height) {
    const w = this.canvas.width;
    const h = this.canvas.height;
    let scale = Math.max(0.25, Math.min(width / w, height / h));
    if (scale >= MAX_SCALE_WHEN_FRACTIONAL) scale = Math.floor(scale);
    this.canvas.style.width = `${Math.floor(w * scale)}px`;
    this.canvas.style.height = `${Math.floor(h * scale)}px`;
  }
}
