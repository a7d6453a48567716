// Steering input: the keyboard, the on-screen pad (pointer events: hold to move,
// several fingers at once), dragging on the player like a joystick, and a
// gamepad. Every source adds to one set of held keys; `onChange` hears the
// sorted list whenever it changes. Which keys count, and what each is sent as,
// comes from the model card (`keyInput`): W A S D by default, or any key a card's
// `inputs` maps (by KeyboardEvent.code) to the values its controls take, and the
// mouse buttons it maps (by MouseEvent.button) pressed over the world.

export const KEYS = ['w', 'a', 's', 'd'];
const KEY_FOR_CODE = {
  KeyW: 'w', KeyA: 'a', KeyS: 's', KeyD: 'd',
  ArrowUp: 'w', ArrowLeft: 'a', ArrowDown: 's', ArrowRight: 'd',
};
// The pad's, a drag's and the gamepad's directions, as the key codes a card maps.
const LETTER_CODES = { w: 'KeyW', a: 'KeyA', s: 'KeyS', d: 'KeyD' };
const DRAG_DEAD_ZONE_PX = 12;   // a drag shorter than this is a tap, not a steer
const STICK_DEAD_ZONE = 0.5;
const PAD_BUTTONS = { 12: 'w', 13: 's', 14: 'a', 15: 'd' };  // standard gamepad d-pad

/**
 * The controls field held keys go to, what each key code is sent as, and what each mouse button is sent as
 * (by MouseEvent.button, as a string): a card's `inputs` entry of kind `keys`
 * (`{"kind": "keys", "codes": {"KeyW": 87, ...}, "mouse_buttons": {"0": 1, ...}}`, e.g. waypoint-1.5's button
 * ids), else `keys` with W A S D and the arrows as 'w' 'a' 's' 'd' and no mouse buttons.
 */
export function keyInput(card) {
  const inputs = (card && card.inputs) || {};
  for (const [field, input] of Object.entries(inputs)) {
    if (input && input.kind === 'keys' && input.codes && typeof input.codes === 'object') {
      const mouse = input.mouse_buttons && typeof input.mouse_buttons === 'object' ? input.mouse_buttons : {};
      return { field, codes: input.codes, mouseButtons: mouse };
    }
  }
  return { field: 'keys', codes: KEY_FOR_CODE, mouseButtons: {} };
}

/**
 * Whether a model card's controls take held keys: its schema names the keys' field, or leaves room for fields it
 * does not name. A model that takes none (LongLive: steered by prompts alone) refuses every `input` with keys.
 */
export function takesKeys(card) {
  const schema = card && card.controls;
  if (!schema || typeof schema !== 'object') return true;  // no schema: nothing says keys are refused
  const properties = schema.properties || {};
  return keyInput(card).field in properties || schema.additionalProperties !== false;
}

/** True when a key press belongs to a text field (the prompt, the token): steering must not take it. */
export function isTyping(target) {
  if (!target || !target.tagName) return false;
  if (target.isContentEditable || target.tagName === 'TEXTAREA') return true;
  return target.tagName === 'INPUT' && !['button', 'checkbox', 'radio', 'range', 'submit'].includes(target.type);
}

/** Keys a drag of (dx, dy) pixels holds: the drag's direction, like a joystick. */
export function dragKeys(dx, dy) {
  const keys = [];
  if (Math.hypot(dx, dy) < DRAG_DEAD_ZONE_PX) return keys;
  const angle = Math.atan2(dy, dx);
  // Eight sectors: straight moves in a 45-degree cone, diagonals between them.
  const sector = Math.round(angle / (Math.PI / 4));
  const byAxis = { 0: ['d'], 1: ['d', 's'], 2: ['s'], 3: ['a', 's'], 4: ['a'], '-4': ['a'], '-3': ['a', 'w'], '-2': ['w'], '-1': ['d', 'w'] };
  return byAxis[sector] || keys;
}

export class Controls {
  constructor({ onChange, onTypingKey }) {
    this.onChange = onChange;
    this.onTypingKey = onTypingKey || (() => {});
    this.keyboard = new Set();   // physical key codes held
    this.pointers = new Map();   // pointerId -> keys held by that pointer (pad or drag)
    this.gamepad = [];
    this.mouse = new Set();      // mouse buttons held over the world (MouseEvent.button)
    this.last = '';
    this.codes = KEY_FOR_CODE;   // key code -> what the model takes (the card's keyInput)
    this.mouseButtons = {};      // MouseEvent.button -> what the model takes; empty: buttons are not sent
  }

  /** Read the model card: which keys and mouse buttons count and what each is sent as. */
  configure(card) {
    const { codes, mouseButtons } = keyInput(card);
    const same = JSON.stringify([codes, mouseButtons]) === JSON.stringify([this.codes, this.mouseButtons]);
    if (same) return;  // the same model again: keep what is held
    this.codes = codes;
    this.mouseButtons = mouseButtons;
    this.keyboard.clear();
    this.mouse.clear();
    this.changed();
  }

  /** The held keys, as the model takes them, sorted, without repeats. The pad, drags and the gamepad hold
   *  'w' 'a' 's' 'd': sent as the model's values for those keys. */
  keys() {
    const keys = new Set([...this.keyboard].map((code) => this.codes[code]));
    const letter = (key) => this.codes[LETTER_CODES[key]];
    for (const held of this.pointers.values()) for (const key of held) keys.add(letter(key));
    for (const key of this.gamepad) keys.add(letter(key));
    for (const button of this.mouse) keys.add(this.mouseButtons[button]);
    keys.delete(undefined);
    return [...keys].sort();
  }

  changed() {
    const keys = this.keys();
    const signature = keys.join('+');
    if (signature === this.last) return;
    this.last = signature;
    this.onChange(keys);
  }

  /** Let go of everything (the window lost focus, the page paused). */
  releaseAll() {
    this.keyboard.clear();
    this.pointers.clear();
    this.gamepad = [];
    this.mouse.clear();
    this.changed();
  }

  attachKeyboard(target = document) {
    target.addEventListener('keydown', (event) => {
      if (!(event.code in this.codes) || event.ctrlKey || event.metaKey || event.altKey) return;
      if (isTyping(event.target)) {
        this.onTypingKey(event.target);
        return;
      }
      event.preventDefault();  // arrows would scroll the page, or change a focused menu
      this.keyboard.add(event.code);
      this.changed();
    });
    target.addEventListener('keyup', (event) => {
      if (!this.keyboard.delete(event.code)) return;
      event.preventDefault();
      this.changed();
    });
    // Keys released while the window has no focus never send keyup.
    window.addEventListener('blur', () => this.releaseAll());
  }

  /** The on-screen pad: buttons with `data-key`; a finger may slide from one to the next. */
  attachPad(pad) {
    const keyAt = (event) => {
      const el = document.elementFromPoint(event.clientX, event.clientY);
      const button = el && el.closest('[data-key]');
      return button && pad.contains(button) ? button.dataset.key : null;
    };
    const update = (event) => {
      const key = keyAt(event);
      this.pointers.set(event.pointerId, key ? [key] : []);
      this.changed();
    };
    pad.addEventListener('pointerdown', (event) => {
      event.preventDefault();  // no focus change, no text selection, no emulated mouse events
      pad.setPointerCapture(event.pointerId);  // keep the moves even when the finger leaves the pad
      update(event);
    });
    pad.addEventListener('pointermove', (event) => { if (this.pointers.has(event.pointerId)) update(event); });
    const end = (event) => { if (this.pointers.delete(event.pointerId)) this.changed(); };
    for (const type of ['pointerup', 'pointercancel', 'lostpointercapture']) pad.addEventListener(type, end);
    pad.addEventListener('contextmenu', (event) => event.preventDefault());  // a long press is a hold
  }

  /**
   * Dragging on the player steers: the drag's direction from where it began is held until release.
   * While `isLooking()` (a model with a camera: look.js) a drag turns the camera instead.
   */
  attachDrag(surface, isLooking = () => false) {
    const origins = new Map();
    surface.addEventListener('pointerdown', (event) => {
      if (isLooking() || event.button !== 0 || event.target.closest('button, input, select, a, form')) return;
      surface.setPointerCapture(event.pointerId);
      origins.set(event.pointerId, [event.clientX, event.clientY]);
      this.pointers.set(event.pointerId, []);
    });
    surface.addEventListener('pointermove', (event) => {
      const origin = origins.get(event.pointerId);
      if (!origin) return;
      this.pointers.set(event.pointerId, dragKeys(event.clientX - origin[0], event.clientY - origin[1]));
      this.changed();
    });
    const end = (event) => {
      origins.delete(event.pointerId);
      if (this.pointers.delete(event.pointerId)) this.changed();
    };
    for (const type of ['pointerup', 'pointercancel', 'lostpointercapture']) surface.addEventListener(type, end);
  }

  /**
   * Mouse buttons the card maps, pressed over the world, are held like keys. While the pointer is locked
   * (`isLocked()`) every mapped button counts; unlocked, the left button is not a press: it asks for the lock
   * and drags to look (look.js) or to steer (`attachDrag`), and only the other buttons count. A card without
   * `mouse_buttons` changes nothing here: the right button keeps the browser's menu.
   */
  attachMouseButtons(surface, isLocked = () => false) {
    const mapped = (event) => String(event.button) in this.mouseButtons;
    surface.addEventListener('mousedown', (event) => {
      if (!mapped(event) || event.target.closest('button, input, select, a, form')) return;
      if (event.button === 0 && !isLocked()) return;
      event.preventDefault();  // the middle button would start the browser's autoscroll
      this.mouse.add(event.button);
      this.changed();
    });
    // Released anywhere: the pointer may have left the player while the button was down.
    document.addEventListener('mouseup', (event) => {
      if (this.mouse.delete(event.button)) this.changed();
    });
    surface.addEventListener('contextmenu', (event) => {
      if ('2' in this.mouseButtons) event.preventDefault();  // the right button is the model's
    });
  }

  /** Read the first gamepad's left stick and d-pad; call once per animation frame. */
  pollGamepad() {
    const pads = navigator.getGamepads ? navigator.getGamepads() : [];
    const pad = [...pads].find((p) => p && p.connected);
    const keys = [];
    if (pad) {
      const [x = 0, y = 0] = pad.axes;
      if (y < -STICK_DEAD_ZONE) keys.push('w');
      if (y > STICK_DEAD_ZONE) keys.push('s');
      if (x < -STICK_DEAD_ZONE) keys.push('a');
      if (x > STICK_DEAD_ZONE) keys.push('d');
      for (const [index, key] of Object.entries(PAD_BUTTONS)) {
        if (pad.buttons[index] && pad.buttons[index].pressed && !keys.includes(key)) keys.push(key);
      }
    }
    if (keys.join() !== this.gamepad.join()) {
      this.gamepad = keys;
      this.changed();
    }
  }
}
