// Clip recording: the player's frames, scaled up with hard pixel edges onto a
// canvas of their own, captured by MediaRecorder and downloaded as a file.

const CLIP_PX = 512;            // the clip's longer side, near enough (whole-number scale)
const MAX_CLIP_MS = 120000;     // a forgotten recording stops by itself
const TYPES = ['video/webm;codecs=vp9', 'video/webm;codecs=vp8', 'video/webm', 'video/mp4'];

export function recordingSupported() {
  return typeof MediaRecorder !== 'undefined' && TYPES.some((type) => MediaRecorder.isTypeSupported(type))
    && typeof HTMLCanvasElement.prototype.captureStream === 'function';
}

export class ClipRecorder {
  /**
   * @param {HTMLCanvasElement} source  the player's canvas
   * @param {number} fps
   * @param {(blob: Blob, extension: string) => void} onClip
   */
  constructor(source, fps, onClip) {
    this.source = source;
    const scale = Math.max(1, Math.floor(CLIP_PX / Math.max(source.width, source.height)));
    this.canvas = document.createElement('canvas');
    this.canvas.width = source.width * scale;
    this.canvas.height = source.height * scale;
    this.ctx = this.canvas.getContext('2d');
    this.ctx.imageSmoothingEnabled = false;
    this.frame();  // the first picture is what is on screen now
    const type = TYPES.find((t) => MediaRecorder.isTypeSupported(t));
    this.extension = type.startsWith('video/mp4') ? 'mp4' : 'webm';
    this.parts = [];
    this.recorder = new MediaRecorder(this.canvas.captureStream(fps), { mimeType: type });
    this.recorder.ondataavailable = (event) => { if (event.data.size) this.parts.push(event.data); };
    this.recorder.onstop = async () => {
      const clip = new Blob(this.parts, { type });
      // MediaRecorder writes WebM without a duration: players then show none and cannot seek.
      onClip(this.extension === 'webm' ? await withDuration(clip, performance.now() - this.startedAt) : clip,
        this.extension);
    };
    this.recorder.start(1000);  // a part a second: a long clip never sits in one buffer
    this.startedAt = performance.now();
    this.limit = setTimeout(() => this.stop(), MAX_CLIP_MS);
  }

  /** Copy the player's current picture in; called after every drawn frame. */
  frame() {
    this.ctx.drawImage(this.source, 0, 0, this.canvas.width, this.canvas.height);
  }

  get seconds() {
    return (performance.now() - this.startedAt) / 1000;
  }

  stop() {
    clearTimeout(this.limit);
    if (this.recorder.state !== 'inactive') this.recorder.stop();
  }
}

// EBML element ids (Matroska / WebM).
const SEGMENT = 0x18538067;
const INFO = 0x1549a966;
const DURATION = 0x4489;
const UNKNOWN_SIZE = -1;

/** An EBML variable-length integer at `at`: {value, length}; all-ones sizes are "unknown" (-1). */
function readVint(bytes, at, keepMarker = false) {
  const first = bytes[at];
  let length = 1;
  while (length <= 8 && !(first & (0x80 >> (length - 1)))) length += 1;
  if (length > 8) return null;
  let value = keepMarker ? first : first & (0xff >> length);
  let allOnes = value === (0xff >> length);
  for (let i = 1; i < length; i += 1) {
    value = value * 256 + bytes[at + i];
    allOnes = allOnes && bytes[at + i] === 0xff;
  }
  return { value: allOnes && !keepMarker ? UNKNOWN_SIZE : value, length };
}

/**
 * The clip with a Duration element (milliseconds at WebM's default 1 ms timecode scale) added to its
 * Segment's Info. The Info's size keeps its byte width, so nothing else in the file moves; a file this
 * does not understand comes back unchanged.
 */
export async function withDuration(blob, durationMs) {
  const head = new Uint8Array(await blob.slice(0, 65536).arrayBuffer());
  let at = 0;
  const element = () => {
    const id = readVint(head, at, true);
    if (!id) return null;
    const size = readVint(head, at + id.length);
    if (!size) return null;
    return { id: id.value, start: at, sizeAt: at + id.length, sizeLength: size.length,
      body: at + id.length + size.length, size: size.value };
  };
  const ebml = element();
  if (!ebml || ebml.size === UNKNOWN_SIZE) return blob;
  at = ebml.body + ebml.size;
  const segment = element();
  if (!segment || segment.id !== SEGMENT) return blob;
  at = segment.body;
  while (at < head.length - 12) {
    const child = element();
    if (!child || child.size === UNKNOWN_SIZE) return blob;
    if (child.id === INFO) {
      const grown = child.size + 11;  // id (2) + size (1) + float64 (8)
      if (grown >= 2 ** (7 * child.sizeLength) - 1) return blob;
      const patch = new Uint8Array(child.sizeLength + 11);
      for (let i = 0; i < child.sizeLength; i += 1) {
        patch[child.sizeLength - 1 - i] = Math.floor(grown / 256 ** i) & 0xff;
      }
      patch[0] |= 0x80 >> (child.sizeLength - 1);  // the vint's length marker
      const duration = new DataView(patch.buffer, child.sizeLength);
      duration.setUint16(0, DURATION);
      duration.setUint8(2, 0x88);  // size 8
      duration.setFloat64(3, durationMs);
      const infoEnd = child.body + child.size;
      return new Blob([blob.slice(0, child.sizeAt), patch.slice(0, child.sizeLength), blob.slice(child.body, infoEnd),
        patch.slice(child.sizeLength), blob.slice(infoEnd)], { type: blob.type });
    }
    at = child.body + child.size;
  }
  return blob;
}
