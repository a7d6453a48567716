// WebRTC video (docs/PROTOCOL.md, "WebRTC video"): the session's frames on a video track beside its
// WebSocket, which carries the offer and answer (non-trickle: every ICE candidate inside the SDP) and still
// every `chunk` message. A frame shown maps back to its chunk by its RTP timestamp, so key-to-frame is
// measured as on the WebSocket. When the connection fails the server sends the frames on the WebSocket
// again and the page draws them on its canvas, as before.
//
// The page's inputs go on the peer connection's `inputs` data channel while it is open (latest wins: the
// server keeps only the newest pending one), on the WebSocket otherwise. The channel is unordered, so no input
// waits behind a lost one (the server drops one that a newer one overtook), and reliable, because the page
// sends only when its keys change: the last change must arrive.

const RTP_MODULUS = 2 ** 32;
const RTP_CLOCK_HZ = 90000;
const KEEP_CHUNKS = 256;  // chunks remembered for the frames still to be shown

/** Whether this browser can play the track and tell which frame it shows. */
export function webrtcSupported() {
  return typeof RTCPeerConnection === 'function' && 'requestVideoFrameCallback' in HTMLVideoElement.prototype;
}

export class TrackLink {
  /**
   * @param {object} options
   * @param {HTMLVideoElement} options.video  where the track plays (shown over the canvas while connected)
   * @param {number} options.fps              the model's frame rate: the RTP timestamp step
   * @param {(message: object) => void} options.send      sends a message on the session's WebSocket
   * @param {(entry: {applied: number[]}, now: number) => void} options.onShown  a frame was shown
   * @param {(state: string) => void} options.onState     'offered', 'connected', 'failed'
   * @param {object[]} [options.iceServers]  the session's `ready.webrtc.ice_servers` (a TURN relay for a page
   *                                         behind NAT), as RTCPeerConnection takes them
   */
  constructor({ video, fps, send, onShown, onState, iceServers = [] }) {
    this.video = video;
    this.fps = fps;
    this.step = Math.round(RTP_CLOCK_HZ / fps);
    this.send = send;
    this.onShown = onShown;
    this.onState = onState;
    this.iceServers = iceServers;
    this.pc = null;
    this.inputs = null;                 // the `inputs` data channel
    this.connected = false;
    this.codec = null;
    this.anchor = null;                 // {rtp, frame}: a chunk's first frame and its RTP timestamp
    this.applied = new Map();           // a chunk's first track frame -> the event ids it applied, until shown
    this.playUntil = 0;                 // when the frames handed to the track so far will have played
    this.lastShown = -1;
    this.callback = null;
  }

  /** Offer a recvonly video section once ICE gathering is complete. */
  async offer() {
    const pc = new RTCPeerConnection({ iceServers: this.iceServers });
    this.pc = pc;
    pc.addTransceiver('video', { direction: 'recvonly' });
    this.inputs = pc.createDataChannel('inputs', { ordered: false });
    pc.ontrack = (event) => {
      this.video.srcObject = new MediaStream([event.track]);
      this.video.play().catch(() => {});  // muted: autoplay is allowed
    };
    await pc.setLocalDescription(await pc.createOffer());
    if (pc.iceGatheringState !== 'complete') {
      await new Promise((resolve) => {
        const check = () => {
          if (pc.iceGatheringState !== 'complete') return;
          pc.removeEventListener('icegatheringstatechange', check);
          resolve();
        };
        pc.addEventListener('icegatheringstatechange', check);
      });
    }
    if (this.pc !== pc) return;  // closed while gathering
    this.send({ type: 'webrtc_offer', sdp: pc.localDescription.sdp });
    this.onState('offered');
  }

  async answer(message) {
    if (!this.pc) return;
    this.codec = message.codec;
    await this.pc.setRemoteDescription({ type: 'answer', sdp: message.sdp });
  }

  /** The server's `webrtc_state`: frames come on the track while connected, on the WebSocket otherwise. */
  state(message) {
    this.connected = message.state === 'connected';
    this.video.hidden = !this.connected;
    if (this.connected && this.callback === null) {
      this.callback = this.video.requestVideoFrameCallback((now, metadata) => this.shown(metadata));
    }
    this.onState(message.state);
  }

  /** A `chunk` whose frames are on the track. */
  noteChunk(message, now) {
    if (Number.isInteger(message.rtp_timestamp)) this.anchor = { rtp: message.rtp_timestamp, frame: message.track_frame };
    this.applied.set(message.track_frame, message.applied_event_ids || []);
    if (this.applied.size > KEEP_CHUNKS) this.applied.delete(this.applied.keys().next().value);
    this.playUntil = Math.max(this.playUntil, now) + message.frames * 1000 / this.fps;
  }

  /** Playback in hand on the track (as the player's `leadMs` for its canvas). */
  leadMs(now, pendingFrames) {
    return Math.max(0, this.playUntil - now) + pendingFrames * 1000 / this.fps;
  }

  /** Send an `input` on the data channel; false when it is not open (the caller sends it on the WebSocket). */
  sendInput(message) {
    if (!this.inputs || this.inputs.readyState !== 'open') return false;
    this.inputs.send(JSON.stringify(message));
    return true;
  }

  shown(metadata) {
    this.callback = this.video.requestVideoFrameCallback((now, next) => this.shown(next));
    const frame = this.frameOf(metadata.rtpTimestamp);
    if (frame === null || frame <= this.lastShown) return;
    this.lastShown = frame;
    // The chunks that start at this frame or at one the track skipped (lost, or late and dropped): their
    // inputs show now. (The map is in chunk order, so in track frame order.)
    const applied = [];
    for (const [start, ids] of this.applied) {
      if (start > frame) break;
      applied.push(...ids);
      this.applied.delete(start);
    }
    this.onShown({ applied, trackFrame: frame }, performance.now());
  }

  /** The track frame number of an RTP timestamp (null until a chunk message gave the anchor). */
  frameOf(rtp) {
    if (!this.anchor || !Number.isInteger(rtp)) return null;
    const offset = (rtp - this.anchor.rtp + RTP_MODULUS) % RTP_MODULUS;
    if (offset > RTP_MODULUS / 2) return this.anchor.frame - Math.round((RTP_MODULUS - offset) / this.step);
    return this.anchor.frame + Math.round(offset / this.step);
  }

  close() {
    if (this.callback !== null) this.video.cancelVideoFrameCallback(this.callback);
    this.callback = null;
    if (this.pc) this.pc.close();
    this.pc = null;
    this.inputs = null;
    this.inputs = null;                 // the `inputs` data channel
    this.connected = false;
    this.video.hidden = true;
    this.video.srcObject = null;
  }
}
