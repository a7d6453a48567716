// The minimal ARStream browser client's script (client.html; docs/PROTOCOL.md).
const server = new URLSearchParams(location.search).get('server') || `ws://${location.host}/v1/sessions`;
const canvas = document.getElementById('screen');
canvas.style.width = '512px';  // scaled up, pixels kept sharp (set here: the CSP allows no inline style)
canvas.style.imageRendering = 'pixelated';
const status = document.getElementById('status');
const held = new Set();
addEventListener('keydown', (e) => held.add(e.key.toLowerCase()));
addEventListener('keyup', (e) => held.delete(e.key.toLowerCase()));

const ws = new WebSocket(server);
ws.binaryType = 'arraybuffer';
let tickId = 0, inFlight = 0, credits = 1, frames = 0, drawing = Promise.resolve();
const tick = () => {
  while (inFlight < credits) {  // max_pending_ticks in flight: the server's flow control
    const keys = [...held].filter((k) => 'wasd'.includes(k) && k.length === 1);
    ws.send(JSON.stringify({ type: 'tick', tick_id: tickId++, controls: { keys } }));
    inFlight += 1;
  }
};
ws.onopen = () => ws.send(JSON.stringify({ type: 'start', codec: 'jpeg' }));
ws.onmessage = (event) => {
  if (typeof event.data !== 'string') {  // a frame: 20-byte header, then a JPEG; drawn in arrival order
    const jpeg = new Blob([event.data.slice(20)], { type: 'image/jpeg' });
    drawing = drawing.then(async () => {
      const image = await createImageBitmap(jpeg);
      canvas.width = image.width; canvas.height = image.height;
      canvas.getContext('2d').drawImage(image, 0, 0);
      status.textContent = `frames: ${++frames}`;
    });
    return;
  }
  const message = JSON.parse(event.data);
  if (message.type === 'ready') { credits = message.limits.max_pending_ticks; tick(); }
  if (message.type === 'chunk') { inFlight -= 1; tick(); }
  if (message.type === 'error') status.textContent = `error ${message.code}: ${message.message}`;
};
ws.onclose = (event) => { status.textContent += ` (closed ${event.code})`; };
