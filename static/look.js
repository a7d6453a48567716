// Mouse look: for a model whose controls schema has a camera (the card's `mouse`
// names it, e.g. matrix-game-2's {"camera": {"pitch", "yaw"}}), mouse movement
// over the player turns the camera. A click on the world locks the pointer
// (Esc releases it); a drag on the world (mouse or finger) looks around too,
// since the pad and the keys already move. The movement is summed between
// ticks and each tick carries it spread over its chunk's frames, clamped to
// the schema's bounds. A model without a camera gets none of this. A card may
// instead name a field of kind `pointer_delta` in its `inputs` (waypoint-1.5's
// `mouse`): the pointer's movement since the last tick as [dx, dy], screen axes
// (x right, y down), in CSS pixels times the input's `per_pixel` (default 1),
// not spread over the frames (the model takes one movement a chunk, as
// Overworld's engine sums the movement between generations); and a field of kind
// `wheel_sign` gets the wheel's direction over the player since the last tick
// (1 rolled away, -1 towards, 0 still).

// Matrix-Game's units are rotation per video frame; its own key-driven camera
// uses 0.1 a frame. 100 px of movement over one chunk sums to 1 unit.
const UNITS_PER_PX = 0.01;
// Screen axes to the schema's axis names; a positive pitch looks up, so it is the mouse's -y.
const HORIZONTAL = { yaw: 1, x: 1 };
const VERTICAL = { pitch: -1, y: 1 };

/**
 * The camera control a model card declares, or null.
 * @returns {{field: string, axes: Array<{name: string, screen: 'x'|'y', sign: number, min: number, max: number}>}|null}
 */
export function cameraControl(card) {
  const properties = card && card.controls && card.controls.properties;
  if (!properties) return null;
  const delta = pointerDelta(card, properties);
  if (delta) return delta;
  const field = typeof card.mouse === 'string' ? card.mouse : 'camera';
  const camera = properties[field];
  if (!camera || camera.type !== 'object' || !camera.properties) return null;
  const axes = [];
  for (const [name, spec] of Object.entries(camera.properties)) {
    const screen = name in HORIZONTAL ? 'x' : name in VERTICAL ? 'y' : null;
    if (!screen || !spec || !['number', 'integer'].includes(spec.type)) continue;
    const sign = screen === 'x' ? HORIZONTAL[name] : VERTICAL[name];
    const min = Number.isFinite(spec.minimum) ? spec.minimum : -Infinity;
    const max = Number.isFinite(spec.maximum) ? spec.maximum : Infinity;
    axes.push({ name, screen, sign, min, max });
  }
  return axes.length ? { field, axes } : null;
}

/** A field the card's `inputs` marks `pointer_delta`, an array of two numbers: the movement as [dx, dy]. */
function pointerDelta(card, properties) {
  for (const [field, input] of Object.entries(card.inputs || {})) {
    const spec = properties[field];
    if (!input || input.kind !== 'pointer_delta' || !spec || spec.type !== 'array') continue;
    const items = spec.items || {};
    const min = Number.isFinite(items.minimum) ? items.minimum : -Infinity;
    const max = Number.isFinite(items.maximum) ? items.maximum : Infinity;
    const axes = [{ name: 0, screen: 'x', sign: 1, min, max }, { name: 1, screen: 'y', sign: 1, min, max }];
    const perPixel = Number.isFinite(input.per_pixel) ? input.per_pixel : 1;
    return { field, array: true, axes, perPixel };
  }
  return null;
}

/** The controls field a card's `inputs` marks `wheel_sign`, or null. */
export function wheelField(card) {
  const properties = (card && card.controls && card.controls.properties) || {};
  for (const [field, input] of Object.entries((card && card.inputs) || {})) {
    if (input && input.kind === 'wheel_sign' && field in properties) return field;
  }
  return null;
}

/**
 * The camera values for `dx, dy` pixels of movement, within the bounds: a camera's rotation spread over
 * `frames` frames, a pointer delta's movement for the whole chunk.
 */
export function cameraValues(control, dx, dy, frames) {
  const values = control.array ? [] : {};
  for (const axis of control.axes) {
    const px = axis.screen === 'x' ? dx : dy;
    const value = control.array ? axis.sign * px * control.perPixel : (axis.sign * px * UNITS_PER_PX) / Math.max(1, frames);
    values[axis.name] = Math.min(axis.max, Math.max(axis.min, value)) + 0;  // + 0 turns -0 into 0
  }
  return values;
}

export class MouseLook {
  /**
   * @param {HTMLElement} surface  the player: clicks lock the pointer, drags look
   * @param {object} hooks         onLockChange(locked), onMove() when movement arrives
   */
  constructor(surface, { onLockChange = () => {}, onMove = () => {} } = {}) {
    this.surface = surface;
    this.onLockChange = onLockChange;
    this.onMove = onMove;
    this.control = null;   // from the model card; null: the model has no camera
    this.dx = 0;           // movement since the last tick, in CSS pixels
    this.dy = 0;
    this.drags = new Map();  // pointerId -> last [x, y]
    this.wheel = null;     // the card's wheel_sign field, or null
    this.rolled = 0;       // the wheel's direction since the last tick
    this.attach();
  }

  get active() {
    return this.control !== null;
  }

  get locked() {
    return document.pointerLockElement === this.surface;
  }

  /** Read the model card: look around only when its schema has a camera. */
  configure(card) {
    this.control = cameraControl(card);
    this.wheel = this.control ? wheelField(card) : null;
    this.dx = 0;
    this.dy = 0;
    this.rolled = 0;
    if (!this.control && this.locked) document.exitPointerLock();
  }

  add(dx, dy) {
    if (!this.active || (!dx && !dy)) return;
    this.dx += dx;
    this.dy += dy;
    this.onMove();
  }

  /** The controls field for the next tick ({field: values}), the movement since the last one spread over `frames`. */
  take(frames) {
    if (!this.active) return null;
    const values = cameraValues(this.control, this.dx, this.dy, frames);
    this.dx = 0;
    this.dy = 0;
    const taken = { [this.control.field]: values };
    if (this.wheel) taken[this.wheel] = this.rolled;
    this.rolled = 0;
    return taken;
  }

  /** The camera at rest (no movement), e.g. for a reset tick. */
  still() {
    if (!this.active) return null;
    const still = { [this.control.field]: cameraValues(this.control, 0, 0, 1) };
    if (this.wheel) still[this.wheel] = 0;
    return still;
  }

  attach() {
    const surface = this.surface;
    const onWorld = (event) => !event.target.closest('button, input, select, a, form');
    surface.addEventListener('pointerdown', (event) => {
      if (!this.active || event.button !== 0 || !onWorld(event)) return;
      if (event.pointerType === 'mouse' && !this.locked && surface.requestPointerLock) {
        // Some browsers return a promise that rejects (e.g. right after Esc); dragging still looks.
        const asked = surface.requestPointerLock();
        if (asked && asked.catch) asked.catch(() => {});
      }
      if (this.locked) return;
      try {
        surface.setPointerCapture(event.pointerId);  // keep the drag when it leaves the player
      } catch {
        // A pointer lock on its way takes the pointer over: the drag still looks while over the player.
      }
      this.drags.set(event.pointerId, [event.clientX, event.clientY]);
    });
    surface.addEventListener('pointermove', (event) => {
      if (this.locked) return;  // the locked mouse is read from `mousemove` below
      const last = this.drags.get(event.pointerId);
      if (!last) return;
      this.drags.set(event.pointerId, [event.clientX, event.clientY]);
      this.add(event.clientX - last[0], event.clientY - last[1]);
    });
    const end = (event) => this.drags.delete(event.pointerId);
    for (const type of ['pointerup', 'pointercancel', 'lostpointercapture']) surface.addEventListener(type, end);
    surface.addEventListener('wheel', (event) => {
      if (!this.wheel || !event.deltaY || !onWorld(event)) return;
      event.preventDefault();  // the wheel over the world is the model's, not the page's scroll
      this.rolled = event.deltaY < 0 ? 1 : -1;
      this.onMove();
    }, { passive: false });
    document.addEventListener('mousemove', (event) => {
      if (this.locked) this.add(event.movementX, event.movementY);
    });
    document.addEventListener('pointerlockchange', () => {
      this.drags.clear();
      this.onLockChange(this.locked);
    });
  }
}
