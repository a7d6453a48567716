// One session over one WebSocket (docs/PROTOCOL.md): `start` -> `ready`, then
// ticks paced by the player's lead, held keys as `input` events, and each
// `chunk` message with its binary frames decoded into the player's buffer.
// What happens after the socket closes is connection.js's business.

import { createDecoder } from './decode.js';
import { keyInput, takesKeys } from './input.js';
import { raiseIdsPast } from './share.js';
import { FrameError, parseFrame } from './wire.js';
import { TrackLink } from './webrtc.js';

// One tick computing and one queued, so the server never waits for the network. The queued
// tick adds no input latency: an input is applied when a chunk starts, not when its tick was sent.
const MAX_TICKS_IN_FLIGHT = 2;

const DEBUG_KEEP = 1000;        // entries kept in each window.arstreamDebug list

export function pushBounded(list, value, keep = DEBUG_KEEP) {
  list.push(value);
  if (list.length > keep) list.shift();
}

export class Session {
  /**
   * @param {object} options
   * @param {string} options.url        the WebSocket URL (token and resume ticket in the query)
   * @param {object} options.start      the `start` message
   * @param {object} options.ids        {tick, event}: the next ids, shared across resumed sessions
   * @param {import('./player.js').Player} options.player
   * @param {object} options.hooks      onReady, onChunk, onError, onClose, onRole, onViewers, onRecording,
   *                                       onSample, log
   * @param {object} options.debug      window.arstreamDebug
   * @param {Function} [options.tickControls]  controls for every tick (a camera's movement), or null
   * @param {object} [options.webrtc]  {video, onShown, onState}: play the frames on a WebRTC track (a controller's
   *                                    or a viewer's, until control passes), or null
   */
  constructor({ url, start, ids, player, hooks, debug, tickControls = () => null, webrtc = null }) {
    this.start = start;
    this.tickControls = tickControls;  // (frames) -> the controls each tick carries, or null for none
    this.ids = ids;
    this.player = player;
    this.hooks = hooks;
    this.debug = debug;
    this.pacer = null;
    this.ready = null;
    this.opened = false;
    this.ended = false;
    this.stopping = false;          // we sent `close` (or closed a socket that never opened)
    this.dropping = false;          // we closed the socket without `close` (a hidden tab)
    this.closedReason = null;       // the `closed` message's reason, if one came
    this.moved = null;              // a `moved` message: the session lives on another replica now
    this.fatal = null;              // the last fatal `error` message
    this.failed = false;            // after session_failed only a reset tick is accepted
    this.resetKeys = null;          // held keys for the reset tick, when one is wanted
    this.lastResetTickId = -1;
    this.rewind = null;             // {to, keys}: the next tick goes back to boundary `to`, with these keys
    this.role = 'controller';       // 'viewer' while watching: no ticks, no input (ready.role, then `role`)
    this.lastTickId = -1;           // the last chunk's tick_id (a viewer that becomes the controller goes past it)
    this.ticksInFlight = new Map(); // tick_id -> performance.now() when sent
    this.eventsSentAt = new Map();  // event_id -> {at, kind}: when sent, until a drawn frame shows it
    this.receiving = null;          // {expected, got, applied, tickId} while a chunk's frames arrive
    this.decoder = null;
    this.decoderCodec = -1;
    this.webrtc = webrtc;
    this.track = null;              // the WebRTC track's link, once offered (webrtc.js)

    this.ws = new WebSocket(url);
    this.ws.binaryType = 'arraybuffer';
    this.ws.onopen = () => {
      this.opened = true;
      this.send(this.start);
    };
    this.ws.onmessage = (event) => {
      if (this.leaving) return;  // what is still in flight for a session the page let go is not played
      if (typeof event.data === 'string') this.onText(JSON.parse(event.data));
      else this.onBinary(event.data);
    };
    this.ws.onclose = (event) => this.onClose(event);
  }

  get live() {
    return this.ready !== null && !this.ended;
  }

  send(message) {
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(message));
  }

  /** End the session politely: the server releases it and closes with 1000. */
  stop() {
    this.stopping = true;
    if (this.live) this.send({ type: 'close' });
    else this.ws.close(1000, 'client stop');
  }

  /** Close the socket without `close`: a server with resume keeps the session for its grace period. */
  drop(reason) {
    this.dropping = true;
    this.ws.close(1000, reason);
  }

  /** On its way out: the page asked it to end; its close event no longer matters. */
  get leaving() {
    return this.stopping || this.dropping;
  }

  get controller() {
    return this.role === 'controller';
  }

  /** Whether the model takes held keys (its card's controls name them); a prompt-only model refuses them. */
  get takesKeys() {
    return this.ready !== null && takesKeys(this.ready.model);
  }

  /** Send an `input` event; returns its id (undefined when this page does not control a live session). */
  sendInput(fields) {
    if (!this.live || !this.controller) return undefined;
    const message = { type: 'input', event_id: this.ids.event++, ...fields };
    // A prompt's figure is prompt to frame; keys and the camera's are key to frame.
    const kind = typeof fields.prompt === 'string' && !fields.controls ? 'prompt' : 'action';
    this.eventsSentAt.set(message.event_id, { at: performance.now(), kind });
    pushBounded(this.debug.sentEventIds, message.event_id);
    // On the WebRTC data channel while it is open (latest wins), else on the WebSocket.
    if (this.track && this.track.sendInput(message)) this.debug.channelInputs += 1;
    else this.send(message);
    return message.event_id;
  }

  /** The next tick starts a new rollout, with these keys held. */
  requestReset(keys) {
    this.resetKeys = keys;
    this.pump(performance.now());
  }

  /** The next tick goes back to chunk boundary `boundary` (one of `chunk.rewind_points`), with these keys held. */
  requestRewind(boundary, keys) {
    this.rewind = { to: boundary, keys };
    this.pump(performance.now());
  }

  /** Hand the controls to a viewer (one of the `viewers` message's ids). */
  passControl(viewerId) {
    if (this.live && this.controller) this.send({ type: 'pass_control', to: viewerId });
  }

  /** Record this session on the server from its next chunk on, or stop (PROTOCOL.md, "Recording"). */
  record(on) {
    if (this.live && this.controller) this.send({ type: 'record', on });
  }

  // ---- from the server ---------------------------------------------------------------

  onText(message) {
    switch (message.type) {
      case 'ready': return this.onReady(message);
      case 'chunk': return this.onChunk(message);
      case 'error': return this.onError(message);
      case 'role': return this.onRole(message);
      case 'viewers':
        this.hooks.onViewers(this, message);
        return undefined;
      case 'recording':
        this.hooks.onRecording(this, message);
        return undefined;
      case 'moved':
        this.moved = message;
        this.hooks.log(`session moved to replica ${String(message.resume).split('.')[0]} `
          + `(next chunk ${message.next_chunk_index})`);
        return undefined;
      case 'closed':
        this.closedReason = message.reason;
        this.hooks.log(`session closed by the server (reason: ${message.reason})`);
        return undefined;
      case 'webrtc_answer':
        if (this.track) this.track.answer(message).catch((error) => this.hooks.log(`WebRTC: ${error}`, 'error'));
        return undefined;
      case 'webrtc_state':
        if (this.track) this.track.state(message);
        return undefined;
      case 'ack':
      case 'pong':
        return undefined;
      default:
        this.hooks.log(`unknown message type ${message.type}`, 'error');
        return undefined;
    }
  }

  onReady(message) {
    this.ready = message;
    this.role = message.role || 'controller';  // a server without viewers sends no role: the controller
    this.hooks.onReady(this, message);
    // A viewer's frames may come on a track of its own too; a server without `ready.webrtc` answers no offer.
    if (this.webrtc && message.webrtc) this.offerTrack();
    this.pump(performance.now());
  }

  /** Offer the WebRTC track; the frames come on the WebSocket until the server says it is connected. */
  offerTrack() {
    const { video, onShown, onState } = this.webrtc;
    this.track = new TrackLink({
      video,
      fps: this.ready.model.fps,
      iceServers: this.ready.webrtc ? this.ready.webrtc.ice_servers : [],
      send: (message) => this.send(message),
      onShown: (entry, now) => onShown(this, entry, now),
      onState: (state) => onState(this, state),
    });
    this.track.offer().catch((error) => {
      this.hooks.log(`WebRTC: ${error}`, 'error');
      onState(this, 'failed');
    });
  }

  /** Control passed: to us (we tick from now on) or away from us (we watch). */
  onRole(message) {
    this.role = message.role;
    if (this.track) {
      // Once control passes, the server sends this socket's frames on the WebSocket for good: let the track go.
      this.track.close();
      this.track = null;
      this.webrtc.onState(this, 'closed');
    }
    if (this.controller) {
      // Ids keep increasing for the session whoever sends them: start past what the last controller used
      // (the server's tick-id floor, `last_tick_id`, and the event ids its chunks showed applied).
      const floor = Number.isInteger(message.last_tick_id) ? message.last_tick_id : -1;
      raiseIdsPast(this.ids, Math.max(this.lastTickId, floor), this.debug.appliedEventIds);
    } else {
      this.ticksInFlight.clear();  // their chunks still come, to everyone; they no longer pace us
      this.eventsSentAt.clear();  // nor do they measure key to frame: that figure is the steerer's
      this.rewind = null;
      this.resetKeys = null;
    }
    this.hooks.onRole(this, message);
    this.pump(performance.now());
  }

  onChunk(message) {
    const now = performance.now();
    const sentAt = this.ticksInFlight.get(message.tick_id);
    if (sentAt !== undefined) this.hooks.onSample('chunk', now - sentAt);
    if (message.timings && Number.isFinite(message.timings.compute_ms)) {
      this.hooks.onSample('compute', message.timings.compute_ms);
    }
    const applied = message.applied_event_ids || [];
    for (const id of applied) pushBounded(this.debug.appliedEventIds, id);
    this.debug.chunksReceived += 1;
    this.lastTickId = message.tick_id;
    this.receiving = { expected: message.frames, got: 0, applied, tickId: message.tick_id, sentAt };
    this.hooks.onChunk(this, message);
    if (message.delivery === 'webrtc' && this.track) {
      // Its frames are on the track, not on this socket: the chunk is here.
      if (sentAt !== undefined && this.pacer) this.pacer.noteLatency(now - sentAt);
      this.track.noteChunk(message, now);
      this.debug.framesReceived += message.frames;
      this.chunkDone(now);
      return;
    }
    if (message.frames === 0) this.chunkDone(now);
  }

  chunkDone(now) {
    // A tick counts as in flight until its last frame is here (the frames still to come count as arriving).
    this.ticksInFlight.delete(this.receiving.tickId);
    this.receiving = null;
    this.pump(now);
  }

  onError(message) {
    pushBounded(this.debug.errors, message);
    // A refused tick never runs: free its credit.
    if (message.tick_id !== undefined && message.tick_id !== null) this.ticksInFlight.delete(message.tick_id);
    if (message.fatal) this.fatal = message;
    if (message.code === 'webrtc_failed' && this.track) {
      this.track.close();  // the frames stay on the WebSocket
      this.webrtc.onState(this, 'failed');
    }
    if (message.code === 'session_failed' && message.tick_id < this.lastResetTickId) {
      // A tick queued before our reset was skipped; the reset tick is already on its way.
    } else if (message.code === 'session_failed') {
      this.failed = true;
    }
    this.hooks.onError(this, message);
    this.pump(performance.now());
  }

  onBinary(buffer) {
    const chunk = this.receiving;
    let frame;
    try {
      if (!chunk) throw new FrameError(`a ${buffer.byteLength}-byte binary message outside any chunk`);
      frame = parseFrame(buffer);
      if (frame.header.codec !== this.decoderCodec) {
        if (this.decoder) this.decoder.close();
        this.decoder = createDecoder(frame.header.codec);
        this.decoderCodec = frame.header.codec;
      }
    } catch (error) {
      this.hooks.log(String(error.message || error), 'error');
      return;
    }
    // The pacer covers the wait for a chunk's first frame: the rest arrive while it plays.
    if (chunk.got === 0 && chunk.sentAt !== undefined && this.pacer) this.pacer.noteLatency(performance.now() - chunk.sentAt);
    const applied = frame.header.frameIndex === 0 ? chunk.applied : [];
    this.player.push(this.decoder.decode(frame.header, frame.payload), applied);
    this.debug.framesReceived += 1;
    chunk.got += 1;
    if (frame.header.last || chunk.got >= chunk.expected) this.chunkDone(performance.now());
  }

  onClose(event) {
    this.ended = true;
    if (this.decoder) this.decoder.close();
    if (this.track) this.track.close();
    this.hooks.onClose(this, event);
  }

  // ---- to the server -----------------------------------------------------------------

  /**
   * Send ticks while the playback in hand (frames queued, arriving and asked
   * for) is within the pacer's target, at most two at a time.
   */
  pump(now) {
    if (!this.live || !this.controller || !this.pacer || (this.failed && !this.resetKeys)) return;
    const framesPerChunk = this.ready.model.frames_per_chunk;
    const limit = Math.min(MAX_TICKS_IN_FLIGHT, this.ready.limits.max_pending_ticks);
    for (;;) {
      const arriving = this.receiving ? this.receiving.expected - this.receiving.got : 0;
      const queuedTicks = this.ticksInFlight.size - (this.receiving ? 1 : 0);
      const pending = arriving + queuedTicks * framesPerChunk;
      // Frames on a connected track play in the video element: its lead paces the ticks instead of the canvas's.
      const lead = this.track && this.track.connected ? this.track.leadMs(now, pending) : this.player.leadMs(now, pending);
      if (this.ticksInFlight.size >= limit || lead > this.pacer.targetLeadMs()) break;
      const tick = { type: 'tick', tick_id: this.ids.tick++ };
      const controls = this.tickControls(framesPerChunk);
      if (controls) tick.controls = controls;
      if (this.resetKeys) {
        tick.reset = true;
        // replaces whatever controls the failed rollout had (a model that takes no keys gets none)
        if (this.takesKeys) tick.controls = { ...controls, [keyInput(this.ready.model).field]: this.resetKeys };
        this.lastResetTickId = tick.tick_id;
        this.resetKeys = null;
        this.failed = false;
      } else if (this.rewind) {
        tick.rewind_to = this.rewind.to;
        // the world goes on from there with what is held now
        if (this.takesKeys) tick.controls = { ...controls, [keyInput(this.ready.model).field]: this.rewind.keys };
        this.rewind = null;
      }
      this.ticksInFlight.set(tick.tick_id, now);
      this.debug.maxTicksInFlight = Math.max(this.debug.maxTicksInFlight, this.ticksInFlight.size);
      pushBounded(this.debug.sentTickIds, tick.tick_id);
      this.send(tick);
    }
  }

  /** Key-to-frame (and prompt-to-frame): a drawn frame shows the events its chunk applied. */
  noteDrawn(entry, now) {
    for (const id of entry.applied) {
      const sent = this.eventsSentAt.get(id);
      if (sent === undefined) continue;
      this.eventsSentAt.delete(id);
      this.hooks.onSample(sent.kind, now - sent.at);
    }
  }
}
