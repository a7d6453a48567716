// The realtime video page: one RealtimeVideoPlayer, a prompt, W A S D and the arrows as camera velocities.
import { RealtimeVideoPlayer, cameraPayload } from './realtime-video.js';

const video = document.getElementById('video');
const status = document.getElementById('status');
const startButton = document.getElementById('start');
const stopButton = document.getElementById('stop');
const held = new Set();
let player = null;

function show(text) {
  status.textContent = text;
}

/** The video at the model's aspect ratio, scaled up to the page's width (CSS caps it), pixels kept sharp. */
async function sizeToModel() {
  const card = await (await fetch('/v1/model')).json();
  video.style.aspectRatio = `${card.width} / ${card.height}`;
  video.dataset.modelSize = `${card.width}x${card.height}`;
  return card;
}
const loadedCard = sizeToModel();

async function start(event) {
  event.preventDefault();
  startButton.disabled = true;
  const card = await loadedCard;
  const url = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/v1/realtime/video`;
  player = new RealtimeVideoPlayer(video, {
    onEvent: (message) => {
      if (message.type === 'video.chunk_metadata') show(`chunk ${message.generation_chunk_index}, ${player.bytes} bytes`);
      if (message.type === 'error') show(`error: ${message.message}`);
      if (message.type === 'session.done') show(`done: ${message.chunks} chunks${message.stopped ? ' (stopped)' : ''}`);
    },
  });
  window.realtimeVideo = player; // for tests and the curious
  try {
    await player.start(url, { model: card.name, prompt: document.getElementById('prompt').value });
    stopButton.disabled = false;
  } catch (error) {
    show(`refused: ${error.message}`);
    startButton.disabled = false;
  }
  player.done.then(() => {
    stopButton.disabled = true;
    startButton.disabled = false;
  });
}

function steer(event, down) {
  if (!player || !['w', 'a', 's', 'd', 'ArrowLeft', 'ArrowRight'].includes(event.key)) return;
  if (event.target instanceof HTMLInputElement) return;
  if (down === held.has(event.key)) return; // key repeat
  if (down) held.add(event.key);
  else held.delete(event.key);
  player.interact({ multi_modal_data: { camera: cameraPayload(held) } });
}

document.getElementById('start-form').addEventListener('submit', start);
stopButton.addEventListener('click', () => player && player.stop());
window.addEventListener('keydown', (event) => steer(event, true));
window.addEventListener('keyup', (event) => steer(event, false));
