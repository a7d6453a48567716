// Plain-language words for every error code and close code in docs/PROTOCOL.md.
// The protocol's own wording goes to the details log; people read these.

/** Error codes (the `error` message's `code`). */
export const ERROR_TEXT = {
  invalid_message: 'The page sent the server a message it could not read. Reloading the page should fix it.',
  invalid_controls: 'The server did not accept those controls for this model.',
  stale_tick: 'The page and the server lost count of frames; the page carries on.',
  too_many_ticks: 'The page asked for frames faster than the server allows; it slows down.',
  stale_event: 'A key press arrived out of order and was ignored.',
  session_failed: 'The model failed while drawing this part of the world.',
  message_too_large: 'The page sent more text than the server accepts (a very long prompt?).',
  start_required: 'The page took too long to start the session.',
  unauthorized: 'This server needs an access token.',
  origin_refused: 'The server does not accept pages opened from this address.',
  over_capacity: 'The server is full: every session slot is taken.',
  over_capacity_own: 'This address (or access token) already has as many sessions as the server allows.',
  loading: 'The server is still loading its model.',
  idle_timeout: 'The session ended because nothing was asked of it for a while.',
  resume_failed: 'Your world could not be picked up again (the server had let it go), so a new one starts.',
  taken_over: 'This world is now playing in another tab or window.',
  rate_limited: 'Too many connections from this address. The page waits and tries again.',
  internal: 'The server ran into a fault of its own.',
  invalid_image: 'The server could not use that start image.',
  rewind_unavailable: 'That moment is no longer kept (the server keeps only the last few), so the world carries on.',
  not_controller: 'You are watching: only the player steers this world.',
  unknown_viewer: 'That viewer has left, so the controls stay with you.',
  control_refused: 'That viewer already holds as many sessions as the server allows, so the controls stay with you.',
  share_failed: 'This share link no longer works: the world it points to has ended, or its server cannot share it.',
};

/** WebSocket close codes. */
export const CLOSE_TEXT = {
  1000: 'The session ended.',
  1001: 'The server stopped (it may be restarting).',
  1006: 'The connection to the server was lost.',
  1008: 'The server refused this session.',
  1009: 'The page sent more text than the server accepts.',
  1011: 'The server ran into a fault of its own.',
  1012: 'The server is restarting.',
  1013: 'The server is full: every session slot is taken.',
  4001: 'The session ended because nothing was asked of it for a while.',
  4002: 'Your world could not be picked up again, so a new one starts.',
  4003: 'This world is now playing in another tab or window.',
  4004: 'The server could not use that start image.',
  4005: 'This share link no longer works: the world it points to has ended, or its server cannot share it.',
};

/** Watching, branching and passing the controls (share links). */
export const SHARE_TEXT = {
  watchedEnded: 'The world you were watching has ended.',
  gotControl: 'You have the controls now: steer the world.',
  passedControl: 'You passed the controls on: you are watching now.',
  badLink: 'This share link cannot be used',
  notHeld: 'That moment of the world is no longer held (the server keeps its recent past, sparser further back), '
    + 'so the branch cannot start there. The world is still live: branch from where it is now.',
};

/** What happened to the world when its server went away (a drain moves it; a crash cannot). */
export const MOVE_TEXT = {
  moving: 'This server is restarting: moving your world to another one…',
  moved: 'Moved to another server: your world carried on where it was.',
  moveLost: 'Moved to another server, but it could not keep your world, so a new one starts.',
  gone: 'The server that held your world is gone, so a new world starts on another server, with the same seed and keys.',
  ended: 'The server stopped and could not keep your world, so a new world starts, with the same seed and keys.',
  draining: 'That server is restarting and takes no new worlds, so the page starts yours on another one.',
};

/** Words for an `error` message, falling back to the server's own text for a code this page does not know. */
export function errorText(code, serverMessage) {
  return ERROR_TEXT[code] || `The server reported a problem: ${serverMessage || code}.`;
}

/** Words for a close code without an `error` before it. */
export function closeText(code) {
  if (CLOSE_TEXT[code]) return CLOSE_TEXT[code];
  if (code >= 4000) return `The server ended the session (code ${code}).`;
  return `The connection closed (code ${code}).`;
}

/** Words for a `/readyz` refusal reason (the server's text is already plain, but may be empty). */
export function notReadyText(reason) {
  return reason ? `The server is not ready: ${reason}.` : 'The server is not ready yet.';
}
