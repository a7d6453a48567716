// Frame decoding, one decoder per session. A decoder turns a parsed frame into
// a picture the player can draw; decoding may be asynchronous and the player
// keeps pictures in arrival order. A stateful video codec (WebCodecs) is one
// more entry in PAGE_CODECS: it gets every frame of its session, in order.

import { createH264Decoder, h264Supported } from './video-decoder.js';
import { FrameError } from './wire.js';

/** @typedef {{source: ImageBitmap | ImageData, close(): void}} Picture */

function rawPicture(header, payload) {
  const { width, height } = header;
  if (payload.length !== width * height * 3) {
    throw new FrameError(`raw frame of ${payload.length} bytes, expected ${width}x${height}x3`);
  }
  const image = new ImageData(width, height);
  const rgba = image.data;
  for (let i = 0, j = 0; i < payload.length; i += 3, j += 4) {
    rgba[j] = payload[i];
    rgba[j + 1] = payload[i + 1];
    rgba[j + 2] = payload[i + 2];
    rgba[j + 3] = 255;
  }
  return { source: image, close() {} };
}

async function jpegPicture(_header, payload) {
  const bitmap = await createImageBitmap(new Blob([payload], { type: 'image/jpeg' }));
  return { source: bitmap, close: () => bitmap.close() };
}

const always = async () => true;

/**
 * The codecs this page reads, by their name in `start` (the page's one table of them, as app/codecs.py is
 * the server's): the ARF1 header id, the menu's label, whether this browser decodes it, a session's decoder.
 */
export const PAGE_CODECS = Object.freeze({
  raw: { id: 0, label: 'raw RGB', supported: always, create: () => ({ decode: async (h, p) => rawPicture(h, p), close() {} }) },
  jpeg: { id: 1, label: 'JPEG', supported: always, create: () => ({ decode: jpegPicture, close() {} }) },
  // WebCodecs; a VideoFrame draws like an ImageBitmap
  h264: { id: 2, label: 'H.264 (WebCodecs)', supported: h264Supported, create: createH264Decoder },
});

/**
 * A decoder for frames whose header says `codecId`.
 * @returns {{decode(header: object, payload: Uint8Array): Promise<Picture>, close(): void}}
 */
export function createDecoder(codecId) {
  const codec = Object.values(PAGE_CODECS).find((candidate) => candidate.id === codecId);
  if (!codec) throw new FrameError(`frame codec id ${codecId} is not supported by this page`);
  return codec.create();
}

/**
 * The codec menu: each codec the server offers (`GET /v1/codecs`) that this page reads with the same header
 * id and this browser decodes, in the server's order.
 * @param {{codecs: {name: string, id: number}[]}} offer
 * @returns {Promise<{name: string, label: string}[]>}
 */
export async function menuCodecs(offer) {
  const listed = [];
  for (const { name, id } of offer.codecs) {
    const codec = PAGE_CODECS[name];
    if (codec && codec.id === id && (await codec.supported())) listed.push({ name, label: codec.label });
  }
  return listed;
}

export { h264Supported };
