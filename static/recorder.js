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
    this.recorder.onstop = () => onClip(new Blob(this.parts, { type }), this.extension);
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
