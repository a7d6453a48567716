// ARStream demo page: wires the modules to the page. One WebSocket at a time
// (docs/PROTOCOL.md): the player's own session, or a session it watches through
// a share link, and the two roles swap when control passes; docs/demo.md
// describes the page. The realtime video dialect has a page of its own
// (realtime-video-page.js, realtime-video.js).
//
//   wire.js           ARF1 frame header parser
//   decode.js         frame decoders by codec (JPEG, raw, H.264)
//   video-decoder.js  H.264 with WebCodecs, for decode.js
//   player.js         jitter buffer, playback at the model's fps, fit to screen, pacing
//   session.js        one WebSocket session: start/ready, ticks, input, chunks and frames, roles
//   connection.js     reconnect with backoff, resume, waiting for a slot, hidden tabs
//   input.js          keyboard, on-screen pad, drag steering, gamepad
//   look.js           mouse look: the camera, for a model whose controls have one
//   hud.js            badge and details numbers
//   recorder.js       clip recording (MediaRecorder)
//   messages.js       plain-language words for error and close codes
//   share.js          share links (watch, branch), the timeline's rewind points

import { Connection } from './connection.js';
import { menuCodecs } from './decode.js';
import { Controls, isTyping, keyInput, takesKeys } from './input.js';
import { Hud, median } from './hud.js';
import { MouseLook } from './look.js';
import { Player } from './player.js';
import { SHARE_TEXT } from './messages.js';
import { ClipRecorder, recordingSupported } from './recorder.js';
import { pushBounded } from './session.js';
import { playTime, rewindTarget, shareLinks, shareMode, shareParams, timeBack, timelineRange } from './share.js';
import { webrtcSupported } from './webrtc.js';

const TOKEN_KEY = 'arstream-token';
const STATS_POLL_MS = 1000;
const HUD_REFRESH_MS = 250;
const NOTICE_MS = 5000;
const MAX_SEED = 2 ** 32;

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);

// A token in the URL moves to session storage and out of the address bar and history.
if (params.has('token')) {
  sessionStorage.setItem(TOKEN_KEY, params.get('token'));
  params.delete('token');
  const query = params.toString();
  history.replaceState(null, '', `${location.pathname}${query ? `?${query}` : ''}${location.hash}`);
}
const token = () => sessionStorage.getItem(TOKEN_KEY);

function pageSeed() {
  const asked = Number(params.get('seed'));
  if (params.has('seed') && Number.isInteger(asked) && asked >= 0) return asked;
  return crypto.getRandomValues(new Uint32Array(1))[0] % MAX_SEED;
}

// Exposed for tests and for the curious (open the console).
const debug = {
  state: 'idle',
  sessionId: null,
  seed: pageSeed(),
  sentTickIds: [],
  sentEventIds: [],
  appliedEventIds: [],
  chunksReceived: 0,
  framesReceived: 0,
  framesDrawn: 0,
  maxTicksInFlight: 0,
  errors: [],
  lastClose: null,
  connects: 0,
  resumed: 0,
  stalls: 0,
  stallReasons: [],     // what the page said about each stall it explained
  stallLog: [],         // each stall: the session's chunks arrived by then, and what was said ('' nothing)
  heldKeys: [],
  startImage: null, // what the next fresh session starts from: {name} or {upload: file name}; null: the default
  looking: false,   // the model has a camera: mouse movement over the player turns it
  samples: { action: [], prompt: [], chunk: [] },
  steering: null,       // 'keys' or 'prompt': what the model card's controls take
  pacer: null,
  mode: null,           // what this page load is: play, watch or branch (from ?watch= / ?branch=&chunk=)
  role: null,           // 'controller' or 'viewer', from ready.role and `role` messages
  viewers: 0,           // viewers of the session, from `viewers`
  viewerIds: [],        // their ids (the controller's copy of `viewers` has them)
  shareToken: null,     // ready.share.token
  rewindPoints: null,   // the last chunk's rewind_points: [oldest, newest]
  rewindHeld: null,     // the last chunk's rewind_held: every boundary held, oldest first
  rewindSeconds: 0,     // ready.rewind_seconds: how far back the boundaries reach
  chunkIndexes: [],     // chunk_index of every chunk received, in order
  promptChunks: [],     // {prompt, chunk}: the chunk that applied each prompt sent from the prompt box
  restarts: [],         // {chunk, why} for every chunk with `restarted`
  skippedChunks: 0,     // chunks a viewer's slow connection skipped (chunk.skipped_before)
  delivery: 'websocket',  // where the frames come now: 'websocket' or 'webrtc' (a connected track)
  trackFramesShown: 0,  // frames the WebRTC track showed (counted in framesDrawn too)
  shownAt: [],          // performance.now() of each frame shown, on either path (gaps are stalls to a bench)
  channelInputs: 0,     // inputs sent on the WebRTC data channel (the others went on the WebSocket)
};
window.arstreamDebug = debug;
// Send an `input` with any fields, e.g. arstreamDebug.sendInput({controls: {keys: ['w']}}).
// Prompts sent from the box, by event id, until a chunk lists them in applied_event_ids.
const promptsSent = new Map();
debug.sendInput = (fields) => { if (connection.session) connection.session.sendInput(fields); };
// Whether the inputs go on the WebRTC data channel now (open), rather than on the WebSocket.
debug.inputChannelOpen = () => Boolean(connection.session?.track?.inputs?.readyState === 'open');
// Cut the socket without a `close` message, as a network drop would (tests use it).
debug.dropSocket = () => { if (connection.session) connection.session.ws.close(4000, 'dropped on purpose'); };
// The resume token held now (tests resume it from elsewhere to take the session over).
debug.resumeToken = () => connection.ticket;

const mode = shareMode(shareParams(location.search, location.hash));
debug.mode = mode;
// An old link (`?watch=`, `?branch=`): its token moves to the fragment, so a reload or a bookmark sends it nowhere.
const linkInQuery = shareParams(location.search, '').toString() !== '' && !shareParams('', location.hash).toString();
if (linkInQuery && (params.has('watch') || params.has('branch'))) {
  const moved = new URLSearchParams();
  for (const name of ['watch', 'branch', 'chunk']) {
    if (params.has(name)) moved.set(name, params.get(name));
    params.delete(name);
  }
  const query = params.toString();
  history.replaceState(null, '', `${location.pathname}${query ? `?${query}` : ''}#${moved}`);
}
if (mode.kind === 'watch') document.body.dataset.role = 'viewer';  // no steering controls, even before `ready`

let model = null;  // the model card, from /v1/model or `ready`
let recorder = null;
let serverRecording = null;  // ready.record, then `recording`: null where the server records nothing
let recordedToken = null;    // the share token this world's recordings are listed under, once it was recorded
let noticeTimer = null;

// ---- page text ----------------------------------------------------------------------

function log(text, kind = 'info') {
  const item = document.createElement('li');
  item.className = kind;
  item.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
  const list = $('log');
  list.prepend(item);
  while (list.children.length > 100) list.lastChild.remove();
}

function notice(text) {
  const box = $('notice');
  box.textContent = text;
  box.hidden = false;
  log(text);
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => { box.hidden = true; }, NOTICE_MS);
}

const ACTIONS = {
  play: ['Play', () => connection.play()],
  'play-here': ['Play here', () => connection.play()],
  'play-now': ['Reconnect now', () => connection.play()],
  reset: ['Restart world', () => connection.reset()],
  'own-world': ['Start a world of your own', () => { location.assign(location.pathname); }],
  'branch-now': ['Branch from now', () => branchFromNow()],
};

/** The link's chunk leaves the address too, so a reload branches from now rather than asking for it again. */
function branchFromNow() {
  const fragment = new URLSearchParams(location.hash.replace(/^#/, ''));
  fragment.delete('chunk');
  history.replaceState(null, '', `${location.pathname}${location.search}#${fragment}`);
  connection.branchFromNow();
  debug.mode = connection.mode;
}

let softOverlay = false;  // shown until the first frame is drawn

function showOverlay({ text, tone, action, soft }) {
  const overlay = $('overlay');
  if (!text) {
    overlay.hidden = true;
    return;
  }
  $('overlay-text').textContent = text;
  overlay.hidden = false;
  overlay.dataset.tone = tone || 'info';
  // Problems interrupt a screen reader; progress does not.
  overlay.setAttribute('aria-live', tone === 'bad' ? 'assertive' : 'polite');
  softOverlay = Boolean(soft);
  const button = $('overlay-action');
  button.hidden = !ACTIONS[action];
  if (ACTIONS[action]) button.textContent = ACTIONS[action][0];
  button.dataset.action = action || '';
  $('token-form').hidden = action !== 'token';
  if (action === 'token') $('token').value = token() || '';
}

const LIVE_STATES = new Set(['connecting', 'streaming', 'failed', 'reconnecting', 'waiting']);

function onState(state, view) {
  $('hud-status').textContent = state;
  $('hud-status').className = state;
  document.body.dataset.state = state;
  $('play').textContent = LIVE_STATES.has(state) ? 'Stop' : 'Play';
  $('play').classList.toggle('primary', !LIVE_STATES.has(state));
  $('reset').disabled = !(connection.session && connection.session.live && ['streaming', 'failed'].includes(state));
  $('rewind').disabled = state !== 'streaming';
  $('record').disabled = !recorder && state !== 'streaming';
  if (!['streaming', 'failed'].includes(state) && recorder) recorder.stop();
  // The world has ended (or was stopped): what the server recorded of it is offered for download.
  if (['ended', 'stopped'].includes(state) && recordedToken) showRecordings();
  if (state === 'streaming' && !view.text && debug.framesDrawn > 0) {
    showOverlay({});
  } else {
    showOverlay(view);
  }
}

// ---- model card -------------------------------------------------------------------------

function kbd(text) {
  const key = document.createElement('kbd');
  key.textContent = text;
  return key;
}

function showModel(card) {
  model = card;
  const what = card.description ? `: ${card.description}` : '';
  // A model whose controls take no keys is steered by its prompt: no pad or key hints, the prompt box first.
  const keyed = takesKeys(card) || !card.reads_prompt;
  document.body.dataset.steer = keyed ? 'keys' : 'prompt';
  hud.steerBy(keyed ? 'key' : 'prompt');
  debug.steering = keyed ? 'keys' : 'prompt';
  // A card that maps keys itself (`inputs`: waypoint-1.5) takes any key it lists, each as its own button, so the
  // arrows are not W A S D there; the pad still holds W A S D.
  const ownKeys = Object.values(card.inputs || {}).some((input) => input && input.kind === 'keys');
  const mouseButtons = Object.keys(keyInput(card).mouseButtons).length > 0;
  $('player').setAttribute('aria-label', !keyed ? `World view: type a prompt to change what ${card.name} draws`
    : ownKeys ? 'World view: hold any key to play; W A S D move' : 'World view: use W A S D or the arrow keys to move');
  $('howto-keys').replaceChildren(...(ownKeys
    ? ['Hold any key (', kbd('W'), ' ', kbd('A'), ' ', kbd('S'), ' ', kbd('D'), ' move)',
      mouseButtons ? ' or a mouse button over the world' : '', ', hold the pad']
    : ['Hold ', kbd('W'), ' ', kbd('A'), ' ', kbd('S'), ' ', kbd('D'), ' or the arrow keys, hold the pad']));
  const doing = debug.role === 'viewer'
    ? `watching someone ${keyed ? 'steer' : 'prompt'}` : keyed ? 'steering' : 'prompting';
  // Random weights (a test set-up) draw noise: say so, or the page looks broken.
  const random = card.weights === 'random'
    ? ' It runs with random weights (a test set-up, no trained model loaded), so the picture is noise; '
      + 'that is expected.'
    : '';
  $('explain').textContent = `You are ${doing} ${card.name}${what}. The model draws every frame as it is played; `
    + `nothing is pre-recorded.${random}`;
  $('screen').setAttribute('aria-label', `Live video from ${card.name}${what}`);
  $('hud-model').textContent = `${card.name} ${card.width}×${card.height} @ ${card.fps} fps`;
  $('prompt-form').hidden = !card.reads_prompt;
  showStartImages(card);
  controls.configure(card);
  connection.keyField = keyInput(card).field;
  const looked = look.active;
  look.configure(card);
  debug.looking = look.active;
  if (look.active && !looked) showLookHint();
  // With a camera a drag on the world looks around (look.js); without one it steers like a joystick (input.js).
  $('howto-drag').textContent = look.active
    ? '; drag on the world to look around' : ', or drag on the world like a joystick';
  const linked = params.get('model');
  if (linked && linked !== card.name) notice(`This link was made for ${linked}; this server runs ${card.name}.`);
  fit();
}

async function loadModelCard() {
  try {
    const response = await fetch('/v1/model', { cache: 'no-store' });
    if (response.ok) showModel(await response.json());
  } catch {
    // The server is away: the connection's own retries say so.
  }
}

// ---- start image ----------------------------------------------------------------------

let startImage = null;   // `start.image` for the next fresh session: {name} or {data}; null: the model's default
let uploadLimit = null;  // ready.limits.max_start_image_bytes, once a session has said it

/** The picker lists the images the card offers; a model that offers none hides it. */
function showStartImages(card) {
  const names = Array.isArray(card.start_images) ? card.start_images : [];
  $('image-form').hidden = names.length === 0;
  const select = $('start-image');
  const listed = JSON.stringify(names);
  if (select.dataset.names === listed) return;
  select.dataset.names = listed;
  select.replaceChildren(...names.map((name) => new Option(name, name)));
  chooseStartImage(null);
}

function chooseStartImage(image, label = '') {
  startImage = image;
  debug.startImage = image ? (image.name ? { name: image.name } : { upload: label }) : null;
  if (!image) {
    const select = $('start-image');
    for (const option of select.querySelectorAll('option[data-upload]')) option.remove();
    select.selectedIndex = 0;
  }
}

/** A picture chosen: the world starts again from it, in a fresh session. */
function restartWith(image, label) {
  chooseStartImage(image, label);
  log(`start image: ${label}; the world starts again from it`);
  connection.restart();
}

function fileAsBase64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(',', 2)[1] || '');  // the data URL's payload
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

$('start-image').addEventListener('change', () => {
  const option = $('start-image').selectedOptions[0];
  $('start-image').blur();  // back to steering
  if (option && !option.dataset.upload) restartWith({ name: option.value }, option.value);
});
$('image-upload').addEventListener('click', () => $('image-file').click());
$('image-file').addEventListener('change', async () => {
  const file = $('image-file').files[0];
  $('image-file').value = '';  // choosing the same file again is a choice too
  if (!file) return;
  if (uploadLimit !== null && file.size > uploadLimit) {
    const kib = (bytes, round) => round(bytes / 1024);
    notice(`That picture is ${kib(file.size, Math.ceil)} KiB; this server takes at most ${kib(uploadLimit, Math.floor)} KiB.`);
    return;
  }
  let data;
  try {
    data = await fileAsBase64(file);
  } catch (error) {
    notice(`The picture could not be read: ${error.message}`);
    return;
  }
  const select = $('start-image');
  let option = select.querySelector('option[data-upload]');
  if (!option) {
    option = new Option('', '');
    option.dataset.upload = '1';
    select.append(option);
  }
  option.textContent = `your picture: ${file.name}`;
  option.selected = true;
  restartWith({ data }, file.name);
});

// ---- the player -----------------------------------------------------------------------

const hud = new Hud($);
/** A frame reached the screen: drawn on the canvas by the player, or shown by the WebRTC track's video. */
function frameShown(entry, now) {
  debug.framesDrawn += 1;
  pushBounded(debug.shownAt, now);
  hud.drawn(now);
  const session = connection.session;
  if (session) {
    session.noteDrawn(entry, now);
    if (session.pacer) session.pacer.noteDrawn();
  }
  if (recorder) recorder.frame();
  if (softOverlay && connection.state === 'streaming') showOverlay({});
}

const player = new Player($('screen'), {
  onDraw(entry, now) {
    frameShown(entry, now);
  },
  onStall() {
    const session = connection.session;
    if (connection.state !== 'streaming' || !session || !session.pacer) return;
    debug.stalls += 1;
    session.pacer.noteStall();
    // The pacer plans from the chunk latencies it has seen: in a session's first chunks too few, and those need not
    // be typical (waypoint's first chunk, its start image, costs next to nothing; its next one primes the decoder).
    // Running dry there is the pacer learning the pace, not a slow network or a busy server: nothing is said.
    const arrived = session.pacer.latencies.length;
    pushBounded(debug.stallLog, { arrived, said: arrived >= LEARNING_CHUNKS ? explainStall() : '' });
  },
});

/** Where the frames come from, in the HUD: `state` is the WebRTC track's ('offered', 'connected', 'failed'), or
 * null for a session that just started (on the WebSocket until its track connects). */
function showDelivery(state) {
  const session = connection.session;
  debug.delivery = state === 'connected' ? 'webrtc' : 'websocket';
  const codec = session && session.track && session.track.codec ? ` (${session.track.codec})` : '';
  const text = {
    offered: 'WebSocket (WebRTC offered)',
    connected: `WebRTC${codec}`,
    failed: 'WebSocket (WebRTC could not connect)',
    closed: 'WebSocket',
  }[state] ?? 'WebSocket';
  $('hud-delivery').textContent = text;
  if (state === 'failed') log('WebRTC could not connect: the frames come on the WebSocket', 'error');
}

const STALL_NOTICE_EVERY_MS = 20000;  // a stalling stream says why at most this often
const LEARNING_CHUNKS = 4;  // a session's stalls are explained once this many of its chunks have arrived
let stallSaidAt = -Infinity;

/** The picture ran out of frames: say why, in plain words, from the server's compute time per chunk; the words
 * said ('' when nothing is). */
function explainStall() {
  const now = performance.now();
  // (a notice already on the world says something else that matters now: it is not replaced)
  if (now - stallSaidAt < STALL_NOTICE_EVERY_MS || !model || debug.framesDrawn === 0 || !$('notice').hidden) return '';
  stallSaidAt = now;
  const playMs = (1000 * model.frames_per_chunk) / model.fps;  // how long a chunk's frames play
  const computeMs = median(hud.samples.compute);
  const why = Number.isFinite(computeMs) && computeMs > playMs
    ? `the server draws a chunk in ${Math.round(computeMs)} ms, and it plays for ${Math.round(playMs)} ms: `
      + 'this machine draws the world slower than it plays (busy, or too small for this model)'
    : 'they are slow to arrive (the network, or a server busy with other sessions)';
  notice(`Waiting for frames: ${why}.`);
  debug.stallReasons.push(why);
  return why;
}

/** Below this width the fps badge and the role badge do not fit side by side on the picture. */
const BADGES_ROW_PX = 340;

/** Fit the player to the room the layout leaves it (or the whole screen in fullscreen). */
function fit() {
  const box = $('player');
  if (document.fullscreenElement === box) {
    player.fit(window.innerWidth, window.innerHeight);
  } else {
    fitInLayout(box);
  }
  const picture = $('picture');
  picture.toggleAttribute('data-narrow', picture.offsetWidth < BADGES_ROW_PX);
}

function fitInLayout(box) {
  const layout = document.querySelector('.layout');
  const style = getComputedStyle(layout);
  // The media queries of style.css's layouts: stacked (a narrow portrait screen) and beside (a phone on its side).
  const stacked = window.matchMedia('(max-width: 899px) and (orientation: portrait)').matches;
  const beside = window.matchMedia('(max-height: 500px) and (orientation: landscape)').matches;
  const coarse = window.matchMedia('(pointer: coarse)').matches;
  const top = box.getBoundingClientRect().top + window.scrollY;
  // The stage hugs the player, so the room comes from the layout: its width less the side column.
  let width = layout.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  if (beside) {
    // Everything else is in the column beside the world: the world takes the height under the title.
    width -= parseFloat(style.getPropertyValue('--beside-world')) + parseFloat(style.columnGap);
    player.fit(width, window.innerHeight - top - parseFloat(style.paddingBottom));
    return;
  }
  if (!stacked) width -= $('side').offsetWidth + parseFloat(style.columnGap);
  // Room under the player for the controls, and for the pad when it sits below on a touch screen.
  let below = $('controls-bar').offsetHeight + 28;
  // The rewind timeline and the pass-control row, while shown, sit under the controls too.
  for (const row of [$('timeline'), $('pass-box')]) if (row.offsetHeight) below += row.offsetHeight + 10;
  if (stacked && coarse) below += $('pad').offsetHeight + 20;
  const height = window.innerHeight - top - below;
  player.fit(width, Math.max(height, stacked ? width * 0.6 : 240));
}

// ---- the connection ----------------------------------------------------------------------

// Created before the model card arrives; it does nothing until a card with a camera configures it.
const look = new MouseLook($('player'), {
  onLockChange(locked) {
    if (locked) $('hint').hidden = true;
    else if (look.active) showLookHint();
  },
  onMove() { if (!look.locked) $('hint').hidden = true; },
});

function showLookHint() {
  showHint(window.matchMedia('(pointer: coarse)').matches
    ? 'Drag on the world to look around; the pad moves'
    : 'Click the world to look around; Esc releases the mouse');
}

const fixedChunks = Math.max(0, Math.floor(Number(params.get('buffer')) || 0));
const connection = new Connection({
  player,
  token,
  fixedChunks,
  mode: mode.kind === 'bad' ? { kind: 'play' } : mode,
  // WebRTC delivery, where the menu asks for it and this browser can play a track (webrtc.js)
  webrtc: () => ($('delivery').value === 'webrtc' && webrtcSupported()
    ? {
      video: $('screen-video'),
      onShown: (_session, entry, now) => {
        debug.trackFramesShown += 1;
        frameShown(entry, now);
      },
      onState: (_session, state) => showDelivery(state),
    }
    : null),
  startFields: () => {
    const fields = { codec: $('codec').value || undefined, seed: debug.seed };
    const prompt = $('prompt').value.trim();
    if (model && model.reads_prompt && prompt) fields.prompt = prompt;
    if (startImage) fields.image = startImage;
    return fields;
  },
  hooks: {
    onState,
    onReady(_session, ready) {
      showDelivery(null);
      // WebRTC is a choice only where this server answers offers and this browser can play a track
      $('delivery-row').hidden = !(ready.webrtc && webrtcSupported());
      if (!ready.resumed) lastChunkIndex = null;  // another world: its first rewind counts from its own chunks
      // The same world picked up again (a move to another server, a reconnect): its first chunk says whether its
      // rewind points came with it.
      historyBefore = ready.resumed && timeline !== null && timeline.held.length > 2 ? timeline : null;
      uploadLimit = ready.limits.max_start_image_bytes ?? null;
      debug.rewindSeconds = ready.rewind_seconds ?? 0;
      debug.sessionId = ready.session_id;
      debug.shareToken = connection.shareToken;
      debug.viewerIds = [];
      debug.viewers = 0;
      showViewers();
      showTimeline(null, null);
      showModel(ready.model);
      showShareLinks();
      // A resumed session (a reconnect, a move) keeps its recording: under the share token it has now.
      serverRecording = ready.record ?? null;
      if (ready.record) recordedToken = connection.shareToken;
      else if (!ready.resumed) recordedToken = null;
      showServerRecord();
    },
    onChunk(message) {
      $('hud-chunk-index').textContent = `${message.chunk_index} (tick ${message.tick_id})`;
      pushBounded(debug.chunkIndexes, message.chunk_index);
      for (const eventId of message.applied_event_ids || []) {
        const prompt = promptsSent.get(eventId);
        if (prompt === undefined) continue;
        promptsSent.delete(eventId);
        pushBounded(debug.promptChunks, { prompt, chunk: message.chunk_index });
        log(`prompt applied at chunk ${message.chunk_index}: ${prompt}`);
      }
      if (message.restarted === 'rewind' && lastChunkIndex !== null) {
        // How far back the world went: from the live end it was at to the boundary it goes on from.
        notice(`Rewound ${playTime(lastChunkIndex + 1 - message.chunk_index, chunksPerSecond())}: `
          + 'the world goes on from there.');
      }
      lastChunkIndex = message.chunk_index;
      if (message.restarted) {
        pushBounded(debug.restarts, { chunk: message.chunk_index, why: message.restarted });
        log(`chunk ${message.chunk_index}: ${message.restarted === 'rewind' ? 'rewound' : 'new rollout'} (${message.restarted})`);
      }
      if (message.skipped_before) {
        debug.skippedChunks += message.skipped_before;
        log(`${message.skipped_before} chunk(s) skipped: this connection fell behind the world`);
      }
      const before = historyBefore;
      historyBefore = null;
      showTimeline(message.rewind_points ?? null, message.rewind_held ?? null);
      if (before !== null) checkHistory(before);
    },
    onRole(role, message) {
      debug.role = role;
      // a controller by a pass gets the horizon `ready` gave the first one (the timeline and "Share: branch")
      if (role === 'controller' && message && typeof message.rewind_seconds === 'number') {
        debug.rewindSeconds = message.rewind_seconds;
      }
      document.body.dataset.role = role;
      $('hud-role').textContent = role === 'viewer' ? 'viewer (watching)' : 'controller (playing)';
      if (role === 'viewer') controls.releaseAll();
      // Figures of the old role would stay on the badge and in the menu: key to frame starts afresh, and the
      // viewer ids (the controller's to pass to) wait for the server's next `viewers` message.
      hud.forget('action');
      if (role === 'viewer') debug.viewerIds = [];
      showViewers();
      if (model) showModel(model);
    },
    onRecording(message) {
      serverRecording = message.on;
      if (message.on) recordedToken = connection.shareToken;
      log(message.on ? 'the server records this world from its next chunk' : 'server recording stopped');
      showServerRecord();
    },
    onViewers(message) {
      debug.viewers = message.count;
      if (Array.isArray(message.ids)) debug.viewerIds = message.ids;
      showViewers();
    },
    onSample(kind, value) {
      hud.sample(kind, value);
      if (debug.samples[kind]) pushBounded(debug.samples[kind], value);
    },
    log,
    notice,
    onCodecRefused(codec) {
      $('codec').value = codec;
    },
    onImageRefused() {
      chooseStartImage(null);
    },
  },
  debug,
  look,
});

// ---- sharing: the timeline, viewers, links -----------------------------------------------

let timeline = null;     // {min, max, held} from the last chunk's rewind_points and rewind_held, or null
let lastChunkIndex = null;  // the last chunk's chunk_index (a rewind says how far back it went from there)
let historyBefore = null;  // the timeline of a resumed world that had rewind points, until its next chunk

/**
 * A resumed world's rewind points move with it; say so where they did not: all of them stayed behind (the new
 * server keeps none), or its oldest did (it had room for fewer: it keeps the newest). A chunk's own sliding
 * horizon moves the oldest point by a stride at most, far less than the fifth of the reach checked here.
 */
function checkHistory(before) {
  if (timeline === null || timeline.held.length <= 2) {
    historyNote('Its rewind history starts again here: the earlier moments stayed with the old server.');
  } else if (timeline.min - before.min > (before.max - before.min) / 5) {
    const reach = playTime(timeline.max - timeline.min, chunksPerSecond());
    historyNote(`Its oldest rewind points stayed with the old server: the timeline now reaches back ${reach}.`);
  }
}

function historyNote(text) {
  const box = $('notice');
  if (box.hidden) {
    notice(text);
  } else {
    box.textContent = `${box.textContent} ${text}`;  // after "Moved to another server: ..."
    log(text);
  }
}
let scrubbing = false;   // a finger or the mouse is on the timeline: chunks must not move it

/** Chunks of play per second (the model card's fps over its frames per chunk), 0 when unknown. */
function chunksPerSecond() {
  return model && model.fps > 0 && model.frames_per_chunk > 0 ? model.fps / model.frames_per_chunk : 0;
}

/** The timeline's live label: how far back it reaches (ready.rewind_seconds) and how many points it holds. */
function liveLabel() {
  const reach = debug.rewindSeconds > 0 ? `last ${Math.round(debug.rewindSeconds)} s` : timeBack(timeline, timeline.min, chunksPerSecond());
  return `live · ${reach}, ${timeline.held.length - 1} points`;
}

/** The rewind points of the last chunk: the timeline's range and its held points (tick marks); its live end is the newest. */
function showTimeline(points, held) {
  debug.rewindPoints = points;
  debug.rewindHeld = held;
  timeline = timelineRange(points, held);
  if ($('timeline').hidden !== (timeline === null)) {
    $('timeline').hidden = timeline === null;
    fit();  // the player makes room for it, or takes the room back
  }
  if (!timeline || scrubbing) return;
  const slider = $('rewind');
  slider.min = String(timeline.min);
  slider.max = String(timeline.max);
  slider.value = String(timeline.max);
  $('rewind-points').replaceChildren(...timeline.held.map((point) => new Option('', String(point))));
  $('rewind-label').textContent = liveLabel();
}

$('rewind').addEventListener('input', () => {
  scrubbing = true;
  const target = rewindTarget(timeline, Number($('rewind').value));
  $('rewind-label').textContent = target === null ? 'live' : timeBack(timeline, target, chunksPerSecond());
  // Where letting go lands, on the world itself (the label beside the slider is out of sight on a phone).
  $('notice').textContent = target === null ? 'Let go here to stay live' : `Let go to rewind ${$('rewind-label').textContent}`;
  $('notice').hidden = false;
  clearTimeout(noticeTimer);
});
$('rewind').addEventListener('change', () => {
  scrubbing = false;
  $('notice').hidden = true;
  const target = rewindTarget(timeline, Number($('rewind').value));
  $('rewind').blur();  // back to steering
  if (target !== null) connection.rewind(target);
  showTimeline(debug.rewindPoints, debug.rewindHeld);
});

/** The badge on the world ("viewing · 2 watching") and the pass-control menu (the player's, with viewers). */
function showViewers() {
  const viewer = debug.role === 'viewer';
  const count = debug.viewers;
  const watching = count ? `${count} watching` : '';
  $('role-badge').textContent = viewer ? ['viewing', watching].filter(Boolean).join(' · ') : watching;
  $('role-badge').hidden = !viewer && !count;
  const ids = viewer ? [] : debug.viewerIds;
  const select = $('pass-to');
  if (select.dataset.ids !== JSON.stringify(ids)) {
    select.dataset.ids = JSON.stringify(ids);
    select.replaceChildren(...ids.map((id, index) => new Option(`viewer ${index + 1} (${id})`, id)));
  }
  if ($('pass-box').hidden !== (ids.length === 0)) {
    $('pass-box').hidden = ids.length === 0;
    fit();
  }
}

$('pass').addEventListener('click', () => {
  const to = $('pass-to').value;
  if (to) connection.passControl(to);
});

function pageBase() {
  return `${location.origin}${location.pathname}`;
}

/** The watch and branch links, once the session has a share token; a branch starts wherever the world is when the
 * link is opened (a link naming a chunk would die once that boundary is thinned out or past the horizon). */
function showShareLinks() {
  const token = connection.shareToken;
  for (const el of document.querySelectorAll('[data-live-share]')) el.hidden = !token;
  if (!token) return null;
  const links = shareLinks(pageBase(), token);
  $('share-watch').value = links.watch;
  $('share-branch').value = links.branch;
  for (const el of document.querySelectorAll('[for=share-branch], #share-branch')) el.hidden = !debug.rewindSeconds;
  return links;
}

// ---- input ----------------------------------------------------------------------------

const controls = new Controls({
  onChange(keys) {
    debug.heldKeys = keys;
    for (const el of document.querySelectorAll('#pad [data-key]')) el.classList.toggle('held', keys.includes(el.dataset.key));
    if (keys.length) $('hint').hidden = true;
    connection.input(keys);
  },
  onTypingKey(target) {
    if (target.id === 'prompt') showHint('Typing a prompt: press Esc or click the world to steer');
  },
});
controls.attachKeyboard();
controls.attachPad($('pad'));
controls.attachDrag($('player'), () => look.active);  // with a camera, a drag looks around
controls.attachMouseButtons($('player'), () => look.locked);  // a card's mouse buttons (waypoint-1.5)

function showHint(text) {
  $('hint').textContent = text;
  $('hint').hidden = false;
}

// A touch screen without a keyboard or mouse: the first hint names what a finger can do.
if (matchMedia('(hover: none) and (pointer: coarse)').matches) {
  $('hint').textContent = 'Hold an arrow on the pad, or drag on the world';
}

// Keys reach the page only while it has the focus: say how to get it back.
window.addEventListener('blur', () => showHint('Click the world to steer'));
window.addEventListener('focus', () => { if (!isTyping(document.activeElement)) $('hint').hidden = true; });

// Escape leaves a text field and hands the keys back to steering.
document.addEventListener('keydown', (event) => {
  if (event.key === 'Escape' && isTyping(event.target)) {
    event.target.blur();
    $('player').focus({ preventScroll: true });
    $('hint').hidden = true;
  }
});

// A mouse click leaves the focus on a button, and Space or Enter would press it again: hand it back.
for (const button of document.querySelectorAll('.controls button, #overlay-action, #details summary, #image-upload')) {
  button.addEventListener('click', (event) => { if (event.detail > 0) button.blur(); });
}
$('codec').addEventListener('change', () => $('codec').blur());
$('delivery').addEventListener('change', () => $('delivery').blur());
if (params.get('delivery') === 'webrtc') $('delivery').value = 'webrtc';  // a link (or a test) may ask for it

let gamepads = 0;
window.addEventListener('gamepadconnected', () => { gamepads += 1; });
window.addEventListener('gamepaddisconnected', () => { gamepads = Math.max(0, gamepads - 1); });

// ---- controls ----------------------------------------------------------------------------

$('play').addEventListener('click', () => {
  if (LIVE_STATES.has(connection.state)) connection.stop();
  else connection.play();
});
$('reset').addEventListener('click', () => connection.reset());
$('overlay-action').addEventListener('click', () => {
  const action = ACTIONS[$('overlay-action').dataset.action];
  if (action) action[1]();
});
$('token-form').addEventListener('submit', (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $('token').value.trim());
  $('token').blur();
  connection.play();
});
$('prompt-form').addEventListener('submit', (event) => {
  event.preventDefault();
  const prompt = $('prompt').value.trim();
  if (!prompt) return;
  if (connection.session && connection.session.live) {
    const eventId = connection.prompt(prompt);
    if (eventId !== undefined) promptsSent.set(eventId, prompt);
    log(`prompt sent: ${prompt}`);
  } else {
    log('the prompt is used when the next session starts');
  }
  $('prompt').blur();  // back to steering with the keys
  $('hint').hidden = true;
});

function download(blob, extension) {
  const stamp = new Date().toISOString().replace(/[:T]/g, '-').slice(0, 19);
  const link = document.createElement('a');
  link.href = URL.createObjectURL(blob);
  link.download = `arstream-${model ? model.name : 'clip'}-seed${debug.seed}-${stamp}.${extension}`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60000);
  log(`clip saved: ${link.download} (${Math.round(blob.size / 1024)} KiB)`);
}

if (!recordingSupported()) $('record').hidden = true;
$('record').addEventListener('click', () => {
  if (recorder) {
    recorder.stop();
    return;
  }
  if (!model) return;
  recorder = new ClipRecorder($('screen'), model.fps, (blob, extension) => {
    recorder = null;
    $('record').textContent = 'Record';
    $('record').setAttribute('aria-pressed', 'false');
    $('rec-dot').hidden = true;
    onState(connection.state, {});
    download(blob, extension);
  });
  $('record').textContent = 'Stop recording';
  $('record').setAttribute('aria-pressed', 'true');
  $('rec-dot').hidden = false;
});

// ---- recording on the server (PROTOCOL.md, "Recording") ------------------------------------


function showServerRecord() {
  const button = $('server-record');
  button.hidden = serverRecording === null;
  button.textContent = serverRecording ? 'Stop server recording' : 'Record on server';
  button.setAttribute('aria-pressed', String(Boolean(serverRecording)));
  $('recordings').hidden = recordedToken === null;
}

/** List this world's recordings as download links (the share token is what the server asks for them). */
async function showRecordings() {
  const share = recordedToken;
  if (!share) return;
  const query = `share=${encodeURIComponent(share)}`;
  let files = [];
  try {
    const response = await fetch(`/v1/recordings?${query}`, { cache: 'no-store' });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    files = (await response.json()).recordings;
  } catch (error) {
    log(`listing the recordings failed: ${error.message}`, 'error');
    return;
  }
  const items = files.map((file) => {
    const link = document.createElement('a');
    link.href = `/v1/recordings/${encodeURIComponent(file.name)}?${query}`;
    link.download = file.name;
    const kib = Math.max(1, Math.round(file.bytes / 1024));
    link.textContent = `${file.name} (${kib} KiB${file.complete ? '' : ', still recording'})`;
    const item = document.createElement('li');
    item.append(link);
    return item;
  });
  $('recordings-list').replaceChildren(...items);
  $('recordings-note').textContent = files.length ? 'Recorded on the server:' : 'Nothing recorded on the server yet.';
  $('recordings-box').hidden = false;
  debug.recordings = files.map((file) => file.name);
}

$('server-record').addEventListener('click', () => connection.record(!serverRecording));
$('recordings').addEventListener('click', () => showRecordings());

if (!document.fullscreenEnabled) $('fullscreen').hidden = true;
$('fullscreen').addEventListener('click', () => {
  if (document.fullscreenElement) document.exitFullscreen();
  else $('player').requestFullscreen().catch((error) => log(`fullscreen refused: ${error.message}`, 'error'));
});
document.addEventListener('fullscreenchange', () => {
  $('fullscreen').textContent = document.fullscreenElement ? 'Exit fullscreen' : 'Fullscreen';
  fit();
});

$('share').addEventListener('click', async () => {
  const query = new URLSearchParams({ seed: String(debug.seed) });
  if (model) query.set('model', model.name);
  const link = `${pageBase()}?${query}`;
  $('share-link').value = link;
  $('share-box').hidden = false;
  // With a share token, the watch link is the one copied: it shows this very world, live.
  const live = showShareLinks();
  const copied = live ? live.watch : link;
  const what = live ? 'it lets someone watch this world live' : 'it opens this model with the same seed';
  (live ? $('share-watch') : $('share-link')).select();
  try {
    await navigator.clipboard.writeText(copied);
    notice(`Link copied: ${what}.`);
  } catch {
    notice(`Copy a link below: ${what}.`);
  }
});

// ---- the page's life -------------------------------------------------------------------

document.addEventListener('visibilitychange', () => {
  if (document.hidden) {
    controls.releaseAll();
    connection.pause();
  } else {
    connection.wake();
  }
});

new ResizeObserver(() => fit()).observe(document.querySelector('.layout'));
window.addEventListener('resize', fit);

function frame(now) {
  if (gamepads) controls.pollGamepad();
  player.tick(now);
  connection.pump(now);
  if (recorder) $('rec-time').textContent = `${Math.floor(recorder.seconds / 60)}:${String(Math.floor(recorder.seconds % 60)).padStart(2, '0')}`;
  requestAnimationFrame(frame);
}
requestAnimationFrame(frame);

setInterval(() => {
  hud.render(connection.session, connection.session && connection.session.pacer);
}, HUD_REFRESH_MS);

async function pollStats() {
  if (document.hidden || !$('details').open) return;
  try {
    // /v1/stats is open (PROTOCOL.md, "Endpoints"): the session token stays on the WebSocket.
    const response = await fetch('/v1/stats', { cache: 'no-store' });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    hud.stats(await response.json());
  } catch (error) {
    hud.stats(null, error.message);
  }
}
setInterval(pollStats, STATS_POLL_MS);
$('details').addEventListener('toggle', pollStats);

// The codec menu is what the server offers and this browser decodes (H.264 where WebCodecs has it); the server's
// default is chosen. Until it is filled a `start` names no codec, and gets the server's default.
async function loadCodecMenu() {
  try {
    const response = await fetch('/v1/codecs', { cache: 'no-store' });
    if (!response.ok) return;
    const offer = await response.json();
    const listed = await menuCodecs(offer);
    const select = $('codec');
    const chosen = select.value;
    select.replaceChildren(...listed.map(({ name, label }) => new Option(label, name)));
    const names = listed.map(({ name }) => name);
    select.value = [chosen, offer.default, names[0]].find((name) => names.includes(name)) ?? '';
  } catch {
    // The server is away: the connection's own retries say so.
  }
}

loadModelCard();
loadCodecMenu();
if (mode.kind === 'bad') {
  connection.setState('ended', { text: `${SHARE_TEXT.badLink}: ${mode.reason}.`, tone: 'warn', action: 'own-world' });
} else if (params.get('autoconnect') === '0') {
  onState('idle', { text: 'Press Play to start a session.', action: 'play' });
} else if (document.hidden) {
  connection.setState('paused', { text: 'Paused while this tab was hidden.' });  // opened in a background tab
} else {
  connection.play();
}
