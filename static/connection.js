// The connection's life around sessions: start one, pick the same world up
// again after a drop (resume, when the server offers it) or start afresh,
// reconnect with bounded backoff while the server is away, wait for a free
// slot on a full server, and let go while the tab is hidden.

import { MOVE_TEXT, SHARE_TEXT, closeText, errorText, notReadyText } from './messages.js';
import { Pacer } from './player.js';
import { Session } from './session.js';
import { playTime } from './share.js';

const BACKOFF_FIRST_MS = 500;
const BACKOFF_MAX_MS = 8000;
const BACKOFF_ATTEMPTS = 40;   // about five minutes of trying, then a button
const SLOT_POLL_MS = 2000;     // how often a page waiting for a free slot asks /readyz
const REFUSALS_BEFORE_ASKING = 2;  // sockets refused before they open while /readyz says yes

/**
 * States: idle, connecting, streaming, failed (the model failed; Reset
 * recovers), reconnecting, waiting (full server), paused (tab hidden),
 * stopped, needs-token, taken-over, ended (needs a click to play again).
 */
export class Connection {
  /**
   * @param {object} options
   * @param {import('./player.js').Player} options.player
   * @param {() => string | null} options.token      the access token, if any
   * @param {() => object} options.startFields      fields for a fresh `start` (codec, seed, prompt, image)
   * @param {number} options.fixedChunks            0: adaptive buffer; N: keep N chunks ahead
   * @param {object} options.hooks  onState(state, view), onReady(session, ready), onChunk(message),
   *                                onSample(kind, ms), log(text, kind), notice(text), onCodecRefused(codec),
   *                                onImageRefused(), onRole(role, message), onViewers(message),
   *                                onRecording(message)
   * @param {object} [options.mode] what the next fresh session is (share.js shareMode): {kind: 'play'},
   *                                {kind: 'watch', token} or {kind: 'branch', token, chunk}
   * @param {object} options.debug  window.arstreamDebug
   * @param {import('./look.js').MouseLook} [options.look]  the camera, for a model whose controls have one
   * @param {() => object | null} [options.webrtc]  for each session: {video, onShown, onState} to play its frames
   *                                on a WebRTC track (session.js), or null for the WebSocket
   */
  constructor({
    player, token, startFields, fixedChunks, hooks, debug, look = null, mode = { kind: 'play' }, webrtc = () => null,
  }) {
    this.webrtc = webrtc;
    this.player = player;
    this.look = look;
    this.camera = null;                // the camera field the last tick sent ({camera: {...}}), or null
    this.token = token;
    this.startFields = startFields;
    this.fixedChunks = fixedChunks;
    this.hooks = hooks;
    this.debug = debug;
    this.session = null;
    this.state = 'idle';
    this.ids = { tick: 0, event: 0 };  // ids keep increasing across sessions, as resume requires
    this.ticket = null;                // the resume token from the last `ready`, if any
    this.attempts = 0;
    this.refusals = 0;
    this.timer = null;
    this.waitingSince = 0;
    this.keys = [];
    this.keyField = 'keys';            // the controls field held keys go to (the card's keyInput)
    this.afterDrop = false;            // the next `ready` follows a drop: say what happened
    this.afterMove = false;            // the next `ready` follows a move to another replica
    this.mode = mode;                  // play, watch or branch: what a fresh session starts as
    this.shareToken = null;            // ready.share.token of the session this page plays or watches
    this.branchedNotice = null;        // what the page says once a branch is made
  }

  setState(state, view = {}) {
    this.state = state;
    this.debug.state = state;
    this.hooks.onState(state, view);
  }

  clearTimer() {
    clearTimeout(this.timer);
    this.timer = null;
  }

  sessionsUrl() {
    const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
    const query = new URLSearchParams();
    const token = this.token();
    if (token) query.set('token', token);
    if (this.ticket) query.set('resume', this.ticket);
    // A balancer routes a watch or branch to the replica that holds the shared session, as it does a resume.
    else if (this.mode.kind !== 'play') query.set('share', this.mode.token);
    const text = query.toString();
    return `${scheme}://${location.host}/v1/sessions${text ? `?${text}` : ''}`;
  }

  // ---- what the page asks ----------------------------------------------------------------

  /** Start playing: resume the last world when a ticket is held, else a fresh one. */
  play() {
    this.attempts = 0;
    this.refusals = 0;
    this.connect();
  }

  /** The one Stop control: end the session and let its slot go. */
  stop() {
    this.clearTimer();
    this.ticket = null;
    this.player.playing = false;
    if (this.session && !this.session.ended) this.session.stop();
    this.setState('stopped', { text: 'Stopped. Press Play to start again.', action: 'play' });
  }

  /** A fresh session now (a new start image): the current one ends and is not resumed. */
  restart() {
    this.clearTimer();
    this.ticket = null;
    if (this.session && !this.session.ended) this.session.stop();
    this.play();
  }

  /** A branch link's moment is no longer held: branch from where its world is now instead. */
  branchFromNow() {
    if (this.mode.kind !== 'branch') return;
    this.mode = { kind: 'branch', token: this.mode.token, chunk: null };
    this.play();
  }

  /** Record the session on the server from now on, or stop (answered through hooks.onRecording). */
  record(on) {
    if (this.session) this.session.record(on);
  }

  /** Restart the rollout; the reset tick carries the keys held now. */
  reset() {
    if (!this.session || !this.session.live) return;
    this.session.requestReset(this.keys);
    this.player.playing = true;
    this.hooks.log('new rollout requested: the next chunk starts the world again');
    if (this.state === 'failed') this.setState('streaming', {});
  }

  /** The held keys changed. */
  input(keys) {
    this.keys = keys;
    if (this.session && this.session.live) this.sendControls(this.session);
  }

  /** Tell the server what is held now; a model that takes no keys (steered by prompts) is sent none. */
  sendControls(session) {
    if (session.takesKeys) session.sendInput({ controls: this.controls() });
  }

  /**
   * The controls an `input` sends: the held keys, and with a camera the last tick's camera, since
   * the server replaces the whole controls object and a key press must not stop the look.
   */
  controls() {
    const held = { [this.keyField]: this.keys };
    return this.look && this.look.active ? { ...this.camera, ...held } : held;
  }

  /** Every tick of a model with a camera carries the keys and the movement since the last tick. */
  tickControls(frames) {
    if (!this.look || !this.look.active) return null;
    this.camera = this.look.take(frames);
    return { ...this.camera, [this.keyField]: this.keys };
  }

  /** Go back to chunk boundary `boundary` (the timeline); the rewind tick carries the keys held now. */
  rewind(boundary) {
    if (!this.session || !this.session.live || !this.session.controller || this.session.failed) return;
    this.session.requestRewind(boundary, this.keys);
    this.player.playing = true;
    this.hooks.log(`rewind to chunk ${boundary} requested`);
  }

  /** Hand the controls to a viewer; the server answers both sides with `role`. */
  passControl(viewerId) {
    if (!this.session || !this.session.live) return;
    this.session.passControl(viewerId);
    this.hooks.log(`passing control to viewer ${viewerId}`);
  }

  /** Send a prompt as an `input`; returns its event id (the chunk whose applied_event_ids lists it applied it). */
  prompt(text) {
    return this.session && this.session.live ? this.session.sendInput({ prompt: text }) : undefined;
  }

  /** The tab was hidden: give the slot back (keeping the resume ticket when there is one). */
  pause() {
    if (['idle', 'stopped', 'needs-token', 'taken-over', 'ended', 'paused'].includes(this.state)) return;
    this.clearTimer();
    this.player.playing = false;
    const session = this.session;
    this.setState('paused', { text: 'Paused while this tab was hidden.' });
    if (session && !session.ended) {
      if (session.live && this.ticket) session.drop('tab hidden');
      else session.stop();
    }
  }

  /** The tab is visible again. */
  wake() {
    if (this.state !== 'paused') return;
    this.hooks.log(this.ticket ? 'tab visible again: picking the world up' : 'tab visible again: starting a new session');
    this.play();
  }

  pump(now) {
    if (this.session) this.session.pump(now);
  }

  // ---- sessions ----------------------------------------------------------------------

  connect() {
    this.clearTimer();
    // A session still open is kept, unless it is on its way out (Stop, or a hidden tab, then Play at once).
    if (this.session && !this.session.ended && !this.session.leaving) return;
    const resuming = this.ticket !== null;
    const start = { type: 'start', ...this.startFields() };
    if (!resuming && this.mode.kind !== 'play') {
      // A viewer or a branch takes the shared session's world (its seed, prompt and picture): send none.
      delete start.seed;
      delete start.prompt;
      delete start.image;
      if (this.mode.kind === 'watch') start.watch = this.mode.token;
      else start.branch = this.mode.chunk === null ? { share: this.mode.token } : { share: this.mode.token, chunk: this.mode.chunk };
    }
    if (resuming) {
      start.resume = this.ticket;
      delete start.seed;    // the server keeps the session's own; sending them is harmless but misleading
      delete start.prompt;
      delete start.image;   // a resumed session keeps its start image; no need to send it again
    }
    this.debug.connects += 1;
    this.session = new Session({
      url: this.sessionsUrl(),
      start,
      ids: this.ids,
      player: this.player,
      debug: this.debug,
      tickControls: (frames) => this.tickControls(frames),
      webrtc: this.webrtc(),
      hooks: {
        onReady: (s, ready) => this.onReady(s, ready),
        onChunk: (_s, message) => this.hooks.onChunk(message),
        onError: (s, message) => this.onError(s, message),
        onClose: (s, event) => this.onClose(s, event),
        onRole: (s, message) => this.onRole(s, message),
        onViewers: (s, message) => { if (s === this.session) this.hooks.onViewers(message); },
        onRecording: (s, message) => { if (s === this.session) this.hooks.onRecording(message); },
        onSample: this.hooks.onSample,
        log: this.hooks.log,
      },
    });
    this.setState('connecting', { text: resuming ? 'Picking your world up again…' : 'Connecting…' });
  }

  onReady(session, ready) {
    if (session !== this.session) return;
    this.attempts = 0;
    this.refusals = 0;
    this.ticket = ready.resume && ready.resume.token ? ready.resume.token : null;
    // A viewer may get no share token of its own: the one it watches through is the session's.
    const watched = this.mode.kind === 'watch' ? this.mode.token : null;
    this.shareToken = ready.share && ready.share.token ? ready.share.token : watched;
    if (this.mode.kind === 'branch') {
      // The branch exists now: a drop resumes it by its ticket, and a fresh start is a world of its own.
      const chunk = ready.branched_from ? ready.branched_from.chunk : this.mode.chunk;
      this.hooks.log(`branched from chunk ${chunk ?? 'now'}`);
      this.mode = { kind: 'play' };
      const rate = ready.model.fps / ready.model.frames_per_chunk;
      this.branchedNotice = Number.isInteger(chunk)
        ? `You branched this world from ${chunk ? `${playTime(chunk, rate)} into its play` : 'its first frame'}: `
          + 'it is yours to steer, and the original goes on without you.'
        : null;
    }
    this.debug.sessionId = ready.session_id;
    this.debug.resumed += ready.resumed ? 1 : 0;
    this.player.configure(ready.model);
    if (!ready.resumed) this.player.clear();  // a new world: frames of the old one must not play
    this.player.playing = true;
    session.pacer = new Pacer({
      fps: ready.model.fps,
      framesPerChunk: ready.model.frames_per_chunk,
      fixedChunks: this.fixedChunks,
    });
    this.debug.pacer = session.pacer;
    this.hooks.log(`ready: session ${ready.session_id}${ready.resumed ? ' (resumed)' : ''}, `
      + `model ${ready.model.name}, codec ${ready.codec}`);
    if (this.afterMove) {
      this.hooks.notice(ready.resumed ? MOVE_TEXT.moved : MOVE_TEXT.moveLost);
      this.afterMove = false;
      this.afterDrop = false;
    } else if (this.branchedNotice) {
      this.hooks.notice(this.branchedNotice);
      this.branchedNotice = null;
    } else if (this.afterDrop) {
      this.hooks.notice(ready.resumed
        ? 'Reconnected: your world carried on where it was.'
        : 'Reconnected with a new world (the server could not keep the old one).');
      this.afterDrop = false;
    }
    this.camera = null;               // a new session: no look sent yet
    this.hooks.onReady(session, ready);
    this.hooks.onRole(session.role);
    // The server starts with the controls of the session it resumed, or none: tell it what is held now.
    if (ready.resumed || this.keys.length) this.sendControls(session);
    const waitText = session.controller ? 'Generating the first frames…' : 'Waiting for the next frames of this world…';
    this.setState('streaming', ready.resumed ? {} : { text: waitText, soft: true });
  }

  /** Control passed to us, or from us to a viewer. */
  onRole(session, message) {
    if (session !== this.session) return;
    if (session.controller) {
      // The session's resume ticket is ours now (the old controller's is void): a drop picks the world up.
      if (message.resume && message.resume.token) this.ticket = message.resume.token;
      this.mode = { kind: 'play' };
      this.hooks.notice(SHARE_TEXT.gotControl);
      // Tell the server what is held now: the world goes on with this page's keys.
      this.sendControls(session);
    } else {
      // Watching now: a drop comes back as a viewer, through the share token (our resume ticket would take over).
      this.ticket = null;
      if (this.shareToken) this.mode = { kind: 'watch', token: this.shareToken };
      this.hooks.notice(SHARE_TEXT.passedControl);
    }
    this.hooks.log(`role: ${message.role}${message.viewer_id ? ` (viewer ${message.viewer_id})` : ''}`);
    this.hooks.onRole(session.role, message);
  }

  onError(session, message) {
    if (session !== this.session) return;
    if (!session.ready && message.code === 'invalid_message' && session.start.codec === 'h264') {
      // A server that cannot encode H.264 refuses the `start` and waits for another: ask for JPEG.
      session.start = { ...session.start, codec: 'jpeg' };
      session.send(session.start);
      this.hooks.onCodecRefused('jpeg');
      this.hooks.notice('This server does not send H.264 video; using JPEG.');
      return;
    }
    const detail = message.tick_id !== undefined && message.tick_id !== null ? ` (tick ${message.tick_id})` : '';
    this.hooks.log(`${message.fatal ? 'fatal ' : ''}error ${message.code}${detail}: ${message.message}`,
      message.fatal ? 'fatal' : 'error');
    // Refusals a person caused with a click (a scrub too far back, a pass to someone who left): say so.
    if (!message.fatal && ['rewind_unavailable', 'unknown_viewer'].includes(message.code)) {
      this.hooks.notice(errorText(message.code));
    }
    if (message.code === 'session_failed' && session.failed) {
      this.player.playing = false;
      this.setState('failed', { text: errorText('session_failed'), tone: 'bad', action: 'reset' });
    }
  }

  onClose(session, event) {
    if (session !== this.session) return;
    const code = event.code;
    const fatal = session.fatal ? session.fatal.code : null;
    this.debug.lastClose = { code, reason: event.reason, error: fatal };
    const why = event.reason ? `, ${event.reason}` : '';
    const clean = code === 1000 && (session.stopping || ['client', 'tick_close'].includes(session.closedReason));
    this.hooks.log(`connection closed (code ${code}${why})`, clean ? 'info' : 'error');
    if (this.state === 'paused' || this.state === 'stopped') return;  // we let it go on purpose
    if (session.moved && session.moved.resume) {
      // A drained server handed the world to another: follow it at once; the frames already here keep playing.
      this.ticket = session.moved.resume;
      this.afterMove = true;
      this.hooks.notice(MOVE_TEXT.moving);
      this.connect();
      return;
    }
    this.player.playing = false;
    if (fatal) this.ticket = null;  // a fatal error ends the session for good: nothing to resume

    if (session.closedReason === 'session_ended' && !session.controller) {
      // The world we watched ended: there is nothing to come back to.
      this.setState('ended', { text: SHARE_TEXT.watchedEnded, action: 'own-world' });
    } else if (session.closedReason === 'server_shutdown' && session.controller) {
      // The server ended the world as it stopped (no other server could take it): there is nothing to resume.
      // Begin a new one wherever the service answers (a balancer picks another server), same seed and keys.
      this.ticket = null;
      this.afterDrop = false;
      this.hooks.notice(MOVE_TEXT.ended);
      this.setState('reconnecting', { text: `${MOVE_TEXT.ended} Reconnecting…`, tone: 'warn', action: 'play-now' });
      this.probeThenConnect(MOVE_TEXT.ended);
    } else if (fatal === 'share_failed' && this.mode.kind === 'branch' && this.mode.chunk !== null
      && /not held/i.test(session.fatal.message || '')) {
      // The link's moment was thinned out or passed the horizon; the world it names may well be live.
      this.setState('ended', { text: SHARE_TEXT.notHeld, action: 'branch-now' });
    } else if (fatal === 'share_failed' || code === 4005) {
      const why = session.fatal ? ` (${session.fatal.message})` : '';
      this.setState('ended', { text: `${errorText('share_failed')}${why}`, tone: 'warn', action: 'own-world' });
    } else if (clean) {
      this.setState('stopped', { text: 'The session ended. Press Play to start again.', action: 'play' });
    } else if (fatal === 'unauthorized' && /origin/i.test(session.fatal.message || '')) {
      // Not a token problem: no token box; the server's own words say what to change.
      this.setState('ended', {
        text: `${errorText('origin_refused')} (${session.fatal.message})`, tone: 'warn', action: 'play',
      });
    } else if (fatal === 'unauthorized') {
      this.setState('needs-token', { text: errorText('unauthorized'), tone: 'warn', action: 'token' });
    } else if (fatal === 'over_capacity' && /loading|warming/i.test(session.fatal.message || '')) {
      // Not full: the model is still loading. Wait for it in those words.
      this.waitForSlot(errorText('loading'), 'the model to be ready');
    } else if (fatal === 'over_capacity' && /draining/i.test(session.fatal.message || '')) {
      // This server is restarting and takes no new world: another one will, after a short wait.
      this.ticket = null;
      this.hooks.notice(MOVE_TEXT.draining);
      this.retry(MOVE_TEXT.draining);
    } else if (fatal === 'over_capacity' || code === 1013) {
      // A cap on this address or token, rather than a full server, has its own words.
      const own = session.fatal && /client address|token/i.test(session.fatal.message || '');
      this.waitForSlot(own ? errorText('over_capacity_own') : errorText('over_capacity'));
    } else if (fatal === 'resume_failed' || code === 4002) {
      this.ticket = null;
      this.hooks.notice(errorText('resume_failed'));
      this.afterDrop = false;
      this.connect();
    } else if (fatal === 'taken_over' || code === 4003) {
      this.ticket = null;
      this.setState('taken-over', { text: errorText('taken_over'), action: 'play-here' });
    } else if (fatal === 'invalid_image' || code === 4004) {
      // The next Play must not send the same image again: back to the model's own.
      this.hooks.onImageRefused();
      const why = session.fatal ? ` (${session.fatal.message})` : '';
      this.setState('ended', {
        text: `${errorText('invalid_image')}${why} Press Play to start with the model's own picture.`,
        tone: 'warn',
        action: 'play',
      });
    } else if (fatal && fatal !== 'internal') {
      // idle_timeout, start_required, message_too_large, anything new: say it, and let the person start again.
      this.setState('ended', { text: errorText(fatal, session.fatal.message), tone: 'warn', action: 'play' });
    } else if (!session.opened && code === 1006) {
      this.refusedBeforeOpen();
    } else {
      this.afterDrop = true;
      this.retry(fatal ? errorText(fatal) : closeText(code));
    }
  }

  /**
   * The socket closed before it opened. Either the server is away (retry), or
   * it refused the upgrade itself (a bad token, an origin or a per-address
   * limit answer before the WebSocket exists, so the page sees no code).
   */
  async refusedBeforeOpen() {
    const ready = await this.readyz();
    if (this.state !== 'connecting') return;  // stopped or hidden meanwhile
    if (ready.ok && this.ticket) {
      // The service answers but the way to our world does not: the server that held it is gone
      // (a balancer answers its token with 503). Begin again elsewhere, with the same seed and keys.
      this.ticket = null;
      this.afterDrop = false;
      this.hooks.notice(MOVE_TEXT.gone);
      this.hooks.log('resume refused before the socket opened: starting a new session');
      this.connect();
      return;
    }
    if (ready.ok) this.refusals += 1;
    if (this.refusals >= REFUSALS_BEFORE_ASKING) {
      this.setState('needs-token', {
        text: 'The server refused the connection. It may need an access token, or this address '
          + 'may have too many sessions open.',
        tone: 'warn',
        action: 'token',
      });
      return;
    }
    this.afterDrop = this.debug.connects > 1;
    this.retry(closeText(1006));
  }

  /**
   * Try again after a bounded, jittered backoff; /readyz says when the server is back. WHY (what happened to
   * the world) stays on every attempt; NOW says why this attempt could not join (a server still shutting down).
   */
  retry(why, now = '') {
    this.clearTimer();
    this.attempts += 1;
    if (this.attempts > BACKOFF_ATTEMPTS) {
      this.setState('ended', {
        text: `${why}${now ? ` ${now}` : ''} The server has not come back; try again later.`, tone: 'warn', action: 'play',
      });
      return;
    }
    const delay = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** (this.attempts - 1)) * (0.8 + 0.4 * Math.random());
    const seconds = Math.max(1, Math.round(delay / 1000));
    this.setState('reconnecting', {
      text: `${why}${now ? ` ${now}` : ''} Reconnecting in ${seconds} s${this.ticket ? ' to pick your world up again' : ''}… `
        + `(attempt ${this.attempts})`,
      tone: 'warn',
      action: 'play-now',
    });
    this.timer = setTimeout(() => this.probeThenConnect(why), delay);
  }

  async probeThenConnect(why) {
    const ready = await this.readyz();
    if (this.state !== 'reconnecting') return;
    if (ready.ok || (ready.status === 503 && this.ticket)) {
      this.connect();  // a resumed session already holds its slot
    } else if (ready.status === 503 && /slot|capacity|full|admission/i.test(ready.reason || '')) {
      this.waitForSlot();
    } else {
      this.retry(why, ready.status ? notReadyText(ready.reason) : '');
    }
  }

  /** A full server: ask /readyz every two seconds and join as soon as a slot is free. */
  waitForSlot(why = errorText('over_capacity'), waitingFor = 'a free slot') {
    this.clearTimer();
    this.ticket = null;
    if (this.state !== 'waiting') this.waitingSince = performance.now();
    const waited = Math.round((performance.now() - this.waitingSince) / 1000);
    this.setState('waiting', {
      text: `${why} Waiting for ${waitingFor}; you join by yourself as soon as it is.`
        + (waited ? ` (waiting ${waited} s)` : ''),
      tone: 'warn',
    });
    this.timer = setTimeout(async () => {
      const ready = await this.readyz();
      if (this.state !== 'waiting') return;
      if (ready.ok) this.connect();
      else this.waitForSlot(why);
    }, SLOT_POLL_MS);
  }

  /** GET /readyz: {ok, status, reason}; status 0 when the server did not answer. */
  async readyz() {
    try {
      const response = await fetch('/readyz', { cache: 'no-store' });
      let reason = '';
      if (!response.ok) {
        try { reason = (await response.json()).reason || ''; } catch { reason = ''; }
      }
      return { ok: response.ok, status: response.status, reason };
    } catch {
      return { ok: false, status: 0, reason: '' };
    }
  }
}
