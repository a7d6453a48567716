// Sharing a world (docs/PROTOCOL.md, "Rewind, branch and watch"): what a page
// opened from a link should be (a player, a viewer, a branch), the links a
// player hands out, and the timeline's range of rewind points. Plain functions,
// no page state: the tests import this module in Chromium and call them.

/**
 * The parameters a share link carries: from the URL's fragment (`#watch=TOKEN`), which a browser never
 * sends, so the token is in no server's or balancer's access log; else from its query, as links made
 * before the fragment (`?watch=TOKEN`) carried them, which keep working.
 * @param {string} search  location.search
 * @param {string} hash    location.hash
 */
export function shareParams(search, hash) {
  const fragment = new URLSearchParams(hash.replace(/^#/, ''));
  return fragment.has('watch') || fragment.has('branch') ? fragment : new URLSearchParams(search);
}

/**
 * What this page load is, from its share parameters (shareParams):
 *   {kind: 'play'}                              a world of its own (no share parameters)
 *   {kind: 'watch', token}                      `#watch=TOKEN`: a viewer of someone's session
 *   {kind: 'branch', token, chunk}              `#branch=TOKEN&chunk=B`: a new session from that boundary;
 *                                               `#branch=TOKEN` (chunk null): from where that session is when opened
 *   {kind: 'bad', reason}                       a share link the page cannot use (said in plain words)
 * @param {URLSearchParams} params
 */
export function shareMode(params) {
  const watch = params.get('watch');
  const branch = params.get('branch');
  if (watch !== null && branch !== null) return { kind: 'bad', reason: 'the link asks to both watch and branch' };
  if (watch !== null) return watch ? { kind: 'watch', token: watch } : { kind: 'bad', reason: 'the watch link has no token' };
  if (branch === null) return { kind: 'play' };
  if (!branch) return { kind: 'bad', reason: 'the branch link has no token' };
  if (params.get('chunk') === null) return { kind: 'branch', token: branch, chunk: null };
  const chunk = boundaryFromText(params.get('chunk'));
  if (chunk === null) return { kind: 'bad', reason: 'the branch link\'s chunk is not a whole number (chunk=N)' };
  return { kind: 'branch', token: branch, chunk };
}

/** A whole number >= 0 from a URL parameter, or null. */
function boundaryFromText(text) {
  if (text === null || !/^\d{1,10}$/.test(text)) return null;
  const value = Number(text);
  return Number.isSafeInteger(value) && value < 2 ** 32 ? value : null;
}

/**
 * The two links a player hands out, built on this page's own address. The share
 * token is a read-only capability (watch and branch, never steer), carried in the
 * fragment so that opening a link sends it to no server; the access token is
 * never in a link.
 * @param {string} base      origin + path of the page, e.g. "http://127.0.0.1:8000/"
 * @param {string} token     ready.share.token
 * @param {number | null} chunk  the boundary the branch link starts at; null: wherever the world is when
 *                               the link is opened (good for as long as the session lives)
 */
export function shareLinks(base, token, chunk = null) {
  const watch = `${base}#${new URLSearchParams({ watch: token })}`;
  const fields = chunk === null ? { branch: token } : { branch: token, chunk: String(chunk) };
  return { watch, branch: `${base}#${new URLSearchParams(fields)}` };
}

/**
 * The timeline from a chunk's `rewind_points` ([oldest, newest]) and `rewind_held`
 * (every boundary held, oldest first: older ones are thinned out), or null when
 * rewind is off or nothing can be rewound yet (oldest === newest: the only point
 * is "now"). newest is the live end: choosing it is no rewind. A server without
 * `rewind_held` holds every boundary between the two.
 * @param {unknown} points
 * @param {unknown} held
 * @returns {{min: number, max: number, held: number[]} | null}
 */
export function timelineRange(points, held) {
  if (!Array.isArray(points) || points.length !== 2) return null;
  const [oldest, newest] = points;
  if (!Number.isInteger(oldest) || !Number.isInteger(newest) || oldest < 0 || oldest >= newest) return null;
  const listed = Array.isArray(held) && held.length >= 2 && held.every(Number.isInteger)
    && held[0] === oldest && held[held.length - 1] === newest;
  const every = Array.from({ length: newest - oldest + 1 }, (_, i) => oldest + i);
  return { min: oldest, max: newest, held: listed ? held : every };
}

/**
 * The boundary a scrub asks for: the held point nearest the chosen one (the
 * slider moves over chunks, the points are sparser further back; halfway
 * between two, the older), so aiming at 30 s back lands near 30 s back; or null
 * when that is the live end or outside the range (nothing to send).
 * @param {{min: number, max: number, held?: number[]} | null} range
 * @param {number} chosen
 */
export function rewindTarget(range, chosen) {
  if (!range || !Number.isInteger(chosen) || chosen < range.min || chosen >= range.max) return null;
  const held = (range.held ?? [chosen]).filter((point) => point < range.max);
  let target = null;
  for (const point of held) {
    if (target === null || Math.abs(point - chosen) < Math.abs(target - chosen)) target = point;
  }
  return target;
}

/**
 * Words for the timeline: how far back `boundary` is from the live end, in
 * seconds of play. `chunksPerSecond` 0 (unknown): chunks.
 */
export function timeBack(range, boundary, chunksPerSecond) {
  return `${playTime(range.max - boundary, chunksPerSecond)} back`;
}

/** `chunks` of play in words: "1.5 s", "12 s", or "5 chunks" when the play rate is unknown. */
export function playTime(chunks, chunksPerSecond) {
  if (!(chunksPerSecond > 0)) return `${chunks} chunks`;
  const seconds = chunks / chunksPerSecond;
  return `${seconds < 10 ? seconds.toFixed(1) : Math.round(seconds)} s`;
}

/**
 * The next ids a new controller uses: above everything this session has seen,
 * so ids keep increasing for the session whoever sends them.
 * @param {{tick: number, event: number}} ids   the page's next ids (changed in place)
 * @param {number} lastTickId                   the last chunk's tick_id seen, or -1
 * @param {number[]} appliedEventIds            event ids seen in chunks
 */
export function raiseIdsPast(ids, lastTickId, appliedEventIds) {
  ids.tick = Math.max(ids.tick, lastTickId + 1);
  for (const id of appliedEventIds) ids.event = Math.max(ids.event, id + 1);
  return ids;
}
