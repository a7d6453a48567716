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
 *   {kind: 'branch', token, chunk}              `#branch=TOKEN&chunk=B`: a new session from that boundary
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
  const chunk = boundaryFromText(params.get('chunk'));
  if (chunk === null) return { kind: 'bad', reason: 'the branch link names no chunk (chunk=N, a whole number)' };
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
 * @param {number | null} chunk  the boundary "branch from here" starts at; null: no branch link yet
 */
export function shareLinks(base, token, chunk) {
  const watch = `${base}#${new URLSearchParams({ watch: token })}`;
  const branch = chunk === null ? null : `${base}#${new URLSearchParams({ branch: token, chunk: String(chunk) })}`;
  return { watch, branch };
}

/**
 * The timeline's range from a chunk's `rewind_points` ([oldest, newest]), or
 * null when rewind is off or nothing can be rewound yet (oldest === newest: the
 * only point is "now"). newest is the live end: choosing it is no rewind.
 * @param {unknown} points
 */
export function timelineRange(points) {
  if (!Array.isArray(points) || points.length !== 2) return null;
  const [oldest, newest] = points;
  if (!Number.isInteger(oldest) || !Number.isInteger(newest) || oldest < 0 || oldest >= newest) return null;
  return { min: oldest, max: newest };
}

/**
 * The boundary a scrub asks for: the chosen point when it is held and not the
 * live end, else null (nothing to send).
 * @param {{min: number, max: number} | null} range
 * @param {number} chosen
 */
export function rewindTarget(range, chosen) {
  if (!range || !Number.isInteger(chosen)) return null;
  return chosen >= range.min && chosen < range.max ? chosen : null;
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
