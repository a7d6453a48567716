// The numbers: a badge on the player (fps, key-to-frame) and the details
// panel (latencies, buffer, KV blocks and sessions from /v1/stats).

const RECENT = 30;  // samples kept for the medians

export function median(values) {
  if (!values.length) return NaN;
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

function ms(value) {
  return Number.isFinite(value) ? `${value.toFixed(0)} ms` : '–';
}

/** "1 tick", "2 ticks". */
function counted(n, word) {
  return `${n} ${word}${n === 1 ? '' : 's'}`;
}

export class Hud {
  /** @param {(id: string) => HTMLElement} $ */
  constructor($) {
    this.$ = $;
    this.samples = { chunk: [], action: [], prompt: [], compute: [] };
    this.drawnAt = [];
    this.steering = 'key';  // what the steering figure measures: 'key' to frame, or 'prompt' to frame
  }

  /** A model steered by keys shows key to frame; one that takes only prompts shows prompt to frame. */
  steerBy(what) {
    this.steering = what;
    this.set('hud-action-label', `${what} → frame`);
  }

  /** Forget the samples of one kind (key-to-frame after control passed: they were another steering's). */
  forget(kind) {
    this.samples[kind] = [];
  }

  sample(kind, value) {
    const list = this.samples[kind];
    list.push(value);
    if (list.length > RECENT) list.shift();
  }

  drawn(now) {
    this.drawnAt.push(now);
  }

  set(id, text) {
    const el = this.$(id);
    if (el.textContent !== text) el.textContent = text;
  }

  /** Refresh from the live session (or null); cheap, runs a few times a second. */
  render(session, pacer) {
    const now = performance.now();
    while (this.drawnAt.length && this.drawnAt[0] < now - 1000) this.drawnAt.shift();
    const live = session && session.live;
    const fps = live ? this.drawnAt.length : NaN;
    const last = (values) => values[values.length - 1];
    const withMedian = (values) => (values.length ? `${ms(last(values))} (median ${ms(median(values))})` : '–');
    this.set('hud-fps', live ? `${fps} of ${session.ready.model.fps}` : '–');
    this.set('hud-chunk', withMedian(this.samples.chunk));
    const steering = this.steering === 'prompt' ? this.samples.prompt : this.samples.action;
    this.set('hud-action', withMedian(steering));
    this.set('hud-compute', this.samples.compute.length ? `${ms(median(this.samples.compute))} per chunk` : '–');
    if (session && pacer) {
      const queued = session.player.queue.length;
      const ticks = session.ticksInFlight.size;
      this.set('hud-flight', `${counted(ticks, 'tick')} / ${counted(queued, 'frame')}`);
      this.set('hud-target', ms(pacer.targetLeadMs()));
    }
    const toFrame = median(steering);
    const badge = live ? [`${fps} fps`] : [];
    // Key to frame is a steering figure: a viewer's keys move nothing.
    if (live && session.controller && Number.isFinite(toFrame)) badge.push(`${this.steering}→frame ${ms(toFrame)}`);
    this.set('badge', badge.join(' · '));
    this.$('badge').hidden = !live;
  }

  /** Fill the KV and session rows from a /v1/stats document (or an error). */
  stats(stats, error) {
    if (error) {
      this.set('hud-kv', `unavailable (${error})`);
      return;
    }
    const kv = stats.kv || {};
    const pct = kv.blocks_total ? ` (${Math.round((100 * kv.blocks_used) / kv.blocks_total)}%)` : '';
    this.set('hud-kv', `${kv.blocks_used} / ${kv.blocks_total}${pct}`);
    const sessions = stats.sessions || {};
    this.set('hud-sessions', sessions.connected !== undefined
      ? `${sessions.connected} connected, capacity ${kv.session_capacity}` : '–');
  }
}
