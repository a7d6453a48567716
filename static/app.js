// ARStream browser demo: one session over WebSocket, protocol version 1 (see PROTOCOL.md).
//
// The flow: `start` -> `ready`; then keep one or two `tick`s in flight (each asks
// for one chunk), send held keys as `input` events, read each `chunk` message and
// its binary frames into a small jitter buffer, and play that buffer at the
// model's fps on a canvas.
'use strict';

(() => {
  const KEY_FOR_CODE = {
    KeyW: 'w', KeyA: 'a', KeyS: 's', KeyD: 'd',
    ArrowUp: 'w', ArrowLeft: 'a', ArrowDown: 's', ArrowRight: 'd',
  };
  const TICKS_IN_FLIGHT = 2;
  const HEADER_BYTES = 20;
  const FLAG_LAST_FRAME = 1;
  const STATS_POLL_MS = 1000;
  const RECENT = 30;           // samples kept for the HUD medians
  const DEBUG_KEEP = 1000;     // entries kept in window.arstreamDebug lists
  const DISPLAY_PX = 512;

  const $ = (id) => document.getElementById(id);
  const canvas = $('screen');
  const ctx = canvas.getContext('2d');
  const overlay = $('overlay');
  const pageParams = new URLSearchParams(location.search);
  const token = pageParams.get('token');

  // Exposed for tests and for the curious (open the console).
  const debug = {
    state: 'idle',
    sessionId: null,
    sentTickIds: [],
    sentEventIds: [],
    appliedEventIds: [],
    chunksReceived: 0,
    framesReceived: 0,
    framesDrawn: 0,
    maxTicksInFlight: 0,
    errors: [],
    lastClose: null,
  };
  window.arstreamDebug = debug;
  // Send an `input` with any fields, e.g. arstreamDebug.sendInput({controls: {keys: ['w']}}).
  debug.sendInput = (fields) => {
    if (session && session.ready && !session.ended) sendInput(session, fields);
  };

  let session = null;  // the live session's state, null when disconnected
  const hud = { chunkLatency: [], actionLatency: [], compute: [], drawnAt: [] };  // recent samples

  function newSession(ws) {
    return {
      ws,
      ready: null,
      nextTickId: 0,
      nextEventId: 0,
      ticksInFlight: new Map(),   // tick_id -> performance.now() when sent
      eventsSentAt: new Map(),    // event_id -> when sent, until a chunk applies it
      resetNext: false,
      lastSentKeys: '',           // the held keys as last sent; a new session starts with none
      failed: false,              // after session_failed only a reset tick is accepted
      lastResetTickId: -1,
      fatalError: null,           // text of a fatal error, shown again when the close follows
      framesDrawn: 0,
      ended: false,
      receiving: null,            // {message, expected, frames} while a chunk's frames arrive
      queue: [],                  // jitter buffer: frames waiting to be drawn, in order
      nextDrawAt: 0,
    };
  }

  // ---- helpers ------------------------------------------------------------------------

  function pushBounded(list, value) {
    list.push(value);
    if (list.length > DEBUG_KEEP) list.shift();
  }

  function median(values) {
    if (!values.length) return NaN;
    const sorted = [...values].sort((a, b) => a - b);
    const mid = sorted.length >> 1;
    return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
  }

  function ms(value) {
    return Number.isFinite(value) ? `${value.toFixed(0)} ms` : '–';
  }

  function log(text, kind = 'info') {
    const item = document.createElement('li');
    item.className = kind;
    item.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
    const list = $('log');
    list.prepend(item);
    while (list.children.length > 100) list.lastChild.remove();
  }

  function showOverlay(text, fatal = false) {
    overlay.textContent = text;
    overlay.classList.toggle('fatal', fatal);
    overlay.classList.remove('hidden');
  }

  function setState(state) {
    debug.state = state;
    const status = $('hud-status');
    status.textContent = state;
    status.className = state;
    const live = session !== null && !session.ended;
    $('connect').disabled = live;
    $('disconnect').disabled = !live;
    $('reset').disabled = !(live && session.ready);
    $('close').disabled = !(live && session.ready);
  }

  // ---- connection ---------------------------------------------------------------------

  function sessionsUrl() {
    const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
    const query = token ? `?token=${encodeURIComponent(token)}` : '';
    return `${scheme}://${location.host}/v1/sessions${query}`;
  }

  function connect() {
    if (session && !session.ended) return;
    const ws = new WebSocket(sessionsUrl());
    ws.binaryType = 'arraybuffer';
    session = newSession(ws);
    const mine = session;
    setState('connecting');
    showOverlay('Connecting…');
    ws.onopen = () => {
      const start = { type: 'start', codec: $('codec').value };
      const prompt = $('prompt').value.trim();
      if (prompt) start.prompt = prompt;
      send(mine, start);
    };
    ws.onmessage = (event) => {
      if (typeof event.data === 'string') onText(mine, JSON.parse(event.data));
      else onFrame(mine, event.data);
    };
    ws.onerror = () => log('WebSocket error (see the close below)', 'error');
    ws.onclose = (event) => onClose(mine, event);
  }

  function disconnect() {
    if (session && !session.ended) session.ws.close(1000, 'client disconnect');
  }

  function send(s, message) {
    if (s.ws.readyState === WebSocket.OPEN) s.ws.send(JSON.stringify(message));
  }

  function onClose(s, event) {
    s.ended = true;
    debug.lastClose = { code: event.code, reason: event.reason };
    const why = event.reason ? `, ${event.reason}` : '';
    const clean = event.code === 1000;
    log(`connection closed (code ${event.code}${why})`, clean ? 'info' : 'fatal');
    if (s === session) {
      setState('closed');
      if (s.fatalError) showOverlay(`${s.fatalError} (connection closed, code ${event.code})`, true);
      else if (clean) showOverlay('Session closed. Press Connect to play again.');
      else showOverlay(`Connection closed: code ${event.code}${why}`, true);
    }
  }

  // ---- messages from the server -------------------------------------------------------

  function onText(s, message) {
    switch (message.type) {
      case 'ready': return onReady(s, message);
      case 'chunk': return onChunk(s, message);
      case 'error': return onError(s, message);
      case 'closed':
        log(`session closed by server (reason: ${message.reason})`, message.reason === 'client' ? 'info' : 'error');
        return;
      case 'ack':
      case 'pong':
        return;
      default:
        log(`unknown message type ${message.type}`, 'error');
    }
  }

  function onReady(s, message) {
    s.ready = message;
    const model = message.model;
    debug.sessionId = message.session_id;
    canvas.width = model.width;
    canvas.height = model.height;
    // Largest whole-number scale that fits the stage keeps pixels square and crisp.
    const scale = Math.max(1, Math.floor(DISPLAY_PX / Math.max(model.width, model.height)));
    canvas.style.width = `${model.width * scale}px`;
    canvas.style.height = `${model.height * scale}px`;
    $('hud-model').textContent = `${model.name} ${model.width}×${model.height} @ ${model.fps} fps`;
    log(`ready: session ${message.session_id}, model ${model.name}, codec ${message.codec}`);
    showOverlay('Generating the first frames…');
    setState('streaming');
    sendHeldKeys(s);
    pump(s);
  }

  function onChunk(s, message) {
    const sentAt = s.ticksInFlight.get(message.tick_id);
    s.ticksInFlight.delete(message.tick_id);
    const now = performance.now();
    if (sentAt !== undefined) hud.chunkLatency.push(now - sentAt);
    if (hud.chunkLatency.length > RECENT) hud.chunkLatency.shift();
    if (message.timings && Number.isFinite(message.timings.compute_ms)) {
      hud.compute.push(message.timings.compute_ms);
      if (hud.compute.length > RECENT) hud.compute.shift();
    }
    const applied = message.applied_event_ids || [];
    for (const id of applied) pushBounded(debug.appliedEventIds, id);
    if (message.restarted) log(`chunk ${message.chunk_index}: new rollout (${message.restarted})`);
    debug.chunksReceived += 1;
    $('hud-chunk-index').textContent = `${message.chunk_index} (tick ${message.tick_id})`;
    s.receiving = { message, expected: message.frames, got: 0, applied };
    // The next tick goes out now, so the server computes while this chunk plays.
    pump(s);
  }

  function onError(s, message) {
    const about = message.tick_id !== undefined && message.tick_id !== null ? ` (tick ${message.tick_id})` : '';
    const text = `${message.fatal ? 'fatal ' : ''}error ${message.code}${about}: ${message.message}`;
    pushBounded(debug.errors, message);
    log(text, message.fatal ? 'fatal' : 'error');
    // A refused tick never runs: free its credit.
    if (message.tick_id !== undefined) s.ticksInFlight.delete(message.tick_id);
    if (message.code === 'session_failed' && message.tick_id < s.lastResetTickId) {
      pump(s);  // a tick queued before our reset was skipped; the reset tick is already on its way
    } else if (message.code === 'session_failed') {
      s.failed = true;
      setState('failed');
      showOverlay('The model failed on this session. Press Reset to start a new rollout.', true);
    } else if (message.fatal) {
      s.fatalError = `${message.code}: ${message.message}`;
      setState('failed');
      showOverlay(s.fatalError, true);
    } else {
      pump(s);
    }
  }

  function onFrame(s, buffer) {
    const chunk = s.receiving;
    if (!chunk || buffer.byteLength < HEADER_BYTES) {
      log(`unexpected binary message of ${buffer.byteLength} bytes`, 'error');
      return;
    }
    const view = new DataView(buffer);
    const magic = String.fromCharCode(view.getUint8(0), view.getUint8(1), view.getUint8(2), view.getUint8(3));
    if (magic !== 'ARF1') {
      log(`bad frame magic ${JSON.stringify(magic)}`, 'error');
      return;
    }
    const header = {
      codec: view.getUint8(4),
      last: (view.getUint8(5) & FLAG_LAST_FRAME) !== 0,
      frameIndex: view.getUint16(6, true),
      chunkIndex: view.getUint32(8, true),
      tickId: view.getUint32(12, true),
      width: view.getUint16(16, true),
      height: view.getUint16(18, true),
    };
    const payload = buffer.slice(HEADER_BYTES);
    const entry = { image: null, raw: null, applied: header.frameIndex === 0 ? chunk.applied : [] };
    if (header.codec === 1) {
      // Decoding is asynchronous; the entry holds its place in the queue until it resolves.
      createImageBitmap(new Blob([payload], { type: 'image/jpeg' }))
        .then((bitmap) => { entry.image = bitmap; })
        .catch((err) => { entry.broken = true; log(`JPEG decode failed: ${err}`, 'error'); });
    } else {
      entry.raw = rgbToImageData(new Uint8Array(payload), header.width, header.height);
    }
    s.queue.push(entry);
    debug.framesReceived += 1;
    chunk.got += 1;
    if (header.last || chunk.got >= chunk.expected) s.receiving = null;
  }

  function rgbToImageData(rgb, width, height) {
    const image = new ImageData(width, height);
    for (let i = 0, j = 0; i < rgb.length; i += 3, j += 4) {
      image.data[j] = rgb[i];
      image.data[j + 1] = rgb[i + 1];
      image.data[j + 2] = rgb[i + 2];
      image.data[j + 3] = 255;
    }
    return image;
  }

  // ---- messages to the server ---------------------------------------------------------

  // Tick pacing: one or two ticks in flight, and a tick goes out only while the
  // frames buffered, arriving and asked for stay within two chunks, so a model
  // faster than its fps waits for playback instead of piling up latency.
  function pump(s) {
    if (!s.ready || s.ended || (s.failed && !s.resetNext)) return;
    const framesPerChunk = s.ready.model.frames_per_chunk;
    const limit = Math.min(TICKS_IN_FLIGHT, s.ready.limits.max_pending_ticks);
    const arriving = s.receiving ? s.receiving.expected - s.receiving.got : 0;
    while (s.ticksInFlight.size < limit
           && s.queue.length + arriving + (s.ticksInFlight.size + 1) * framesPerChunk <= 2 * framesPerChunk) {
      const tick = { type: 'tick', tick_id: s.nextTickId++ };
      if (s.resetNext) {
        tick.reset = true;
        s.lastResetTickId = tick.tick_id;
        s.resetNext = false;
        s.failed = false;
        setState('streaming');
        overlay.classList.add('hidden');
      }
      s.ticksInFlight.set(tick.tick_id, performance.now());
      debug.maxTicksInFlight = Math.max(debug.maxTicksInFlight, s.ticksInFlight.size);
      pushBounded(debug.sentTickIds, tick.tick_id);
      send(s, tick);
    }
    $('hud-flight').textContent = `${s.ticksInFlight.size} / ${s.queue.length} frames`;
  }

  const held = new Set();       // physical key codes held down

  function heldKeys() {
    return [...new Set([...held].map((code) => KEY_FOR_CODE[code]))].sort();
  }

  function sendInput(s, fields) {
    const message = { type: 'input', event_id: s.nextEventId++, ...fields };
    s.eventsSentAt.set(message.event_id, performance.now());
    pushBounded(debug.sentEventIds, message.event_id);
    send(s, message);
  }

  function sendHeldKeys(s) {
    const keys = heldKeys();
    for (const el of document.querySelectorAll('.keys kbd')) el.classList.toggle('held', keys.includes(el.dataset.key));
    const signature = keys.join('+');
    if (!s || !s.ready || s.ended || signature === s.lastSentKeys) return;
    s.lastSentKeys = signature;
    sendInput(s, { controls: { keys } });
  }

  function isTyping(event) {
    const tag = event.target && event.target.tagName;
    return tag === 'INPUT' || tag === 'TEXTAREA' || tag === 'SELECT';
  }

  document.addEventListener('keydown', (event) => {
    if (!(event.code in KEY_FOR_CODE) || isTyping(event) || event.ctrlKey || event.metaKey || event.altKey) return;
    event.preventDefault();  // arrows would scroll the page
    held.add(event.code);
    sendHeldKeys(session);
  });

  document.addEventListener('keyup', (event) => {
    if (!held.delete(event.code)) return;
    event.preventDefault();
    sendHeldKeys(session);
  });

  // Keys released while the window is not focused never send keyup: let go of everything.
  window.addEventListener('blur', () => {
    held.clear();
    sendHeldKeys(session);
  });

  // ---- playback: the jitter buffer drained at the model's fps ---------------------------

  function draw(s, entry, now) {
    if (entry.image) {
      ctx.drawImage(entry.image, 0, 0);
      entry.image.close();
    } else {
      ctx.putImageData(entry.raw, 0, 0);
    }
    debug.framesDrawn += 1;
    s.framesDrawn += 1;
    if (s.framesDrawn === 1 && !s.failed) overlay.classList.add('hidden');
    hud.drawnAt.push(now);
    for (const id of entry.applied) {
      const sentAt = s.eventsSentAt.get(id);
      if (sentAt === undefined) continue;
      s.eventsSentAt.delete(id);
      hud.actionLatency.push(now - sentAt);
      if (hud.actionLatency.length > RECENT) hud.actionLatency.shift();
    }
  }

  function playback(now) {
    const s = session;
    if (s && s.ready) {
      const interval = 1000 / s.ready.model.fps;
      // Skip frames whose JPEG failed to decode; wait for one still decoding.
      while (s.queue.length && s.queue[0].broken) s.queue.shift();
      const head = s.queue[0];
      if (head && (head.image || head.raw) && now >= s.nextDrawAt) {
        s.queue.shift();
        draw(s, head, now);
        // Stay on the fps grid, but after a stall start again from now instead of bursting.
        s.nextDrawAt = Math.max(s.nextDrawAt + interval, now - interval / 2);
        pump(s);
      }
    }
    requestAnimationFrame(playback);
  }
  requestAnimationFrame(playback);

  // ---- HUD --------------------------------------------------------------------------------

  function refreshHud() {
    const now = performance.now();
    while (hud.drawnAt.length && hud.drawnAt[0] < now - 1000) hud.drawnAt.shift();
    const live = session && session.ready && !session.ended;
    $('hud-fps').textContent = live ? `${hud.drawnAt.length} of ${session.ready.model.fps}` : '–';
    const last = (values) => values[values.length - 1];
    $('hud-chunk').textContent = hud.chunkLatency.length
      ? `${ms(last(hud.chunkLatency))} (median ${ms(median(hud.chunkLatency))})` : '–';
    $('hud-action').textContent = hud.actionLatency.length
      ? `${ms(last(hud.actionLatency))} (median ${ms(median(hud.actionLatency))})` : '–';
    $('hud-compute').textContent = hud.compute.length ? `${ms(median(hud.compute))} per chunk` : '–';
    if (session) $('hud-flight').textContent = `${session.ticksInFlight.size} / ${session.queue.length} frames`;
  }
  setInterval(refreshHud, 250);

  async function pollStats() {
    try {
      const headers = token ? { Authorization: `Bearer ${token}` } : {};
      const response = await fetch('/v1/stats', { headers, cache: 'no-store' });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const stats = await response.json();
      const kv = stats.kv || {};
      const pct = kv.blocks_total ? ` (${Math.round((100 * kv.blocks_used) / kv.blocks_total)}%)` : '';
      $('hud-kv').textContent = `${kv.blocks_used} / ${kv.blocks_total}${pct}`;
      const sessions = stats.sessions || {};
      $('hud-sessions').textContent = sessions.connected !== undefined
        ? `${sessions.connected} connected, capacity ${kv.session_capacity}` : '–';
    } catch (err) {
      $('hud-kv').textContent = `unavailable (${err.message})`;
    }
  }
  setInterval(() => { if (!document.hidden) pollStats(); }, STATS_POLL_MS);
  pollStats();

  // ---- buttons ----------------------------------------------------------------------------

  $('connect').addEventListener('click', connect);
  $('disconnect').addEventListener('click', disconnect);
  $('reset').addEventListener('click', () => {
    if (!session || !session.ready || session.ended) return;
    session.resetNext = true;
    log('reset requested: the next chunk starts a new rollout');
    pump(session);
  });
  $('close').addEventListener('click', () => {
    if (session && session.ready && !session.ended) send(session, { type: 'close' });
  });
  $('prompt-form').addEventListener('submit', (event) => {
    event.preventDefault();
    const prompt = $('prompt').value.trim();
    if (!prompt) return;
    if (session && session.ready && !session.ended) {
      sendInput(session, { prompt });
      log(`prompt sent: ${prompt}`);
    } else {
      log('prompt will be used when you connect');
    }
    $('prompt').blur();  // back to steering with the keys
  });

  setState('idle');
  if (pageParams.get('autoconnect') !== '0') connect();
  else showOverlay('Press Connect to start a session.');
})();
