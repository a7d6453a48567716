// Frame decoding, one decoder per session. A decoder turns a parsed frame into
// a picture the player can draw; decoding may be asynchronous and the player
// keeps pictures in arrival order. A stateful video codec (WebCodecs) is one
// more entry in DECODERS: it gets every frame of its session, in order.

import { createH264Decoder, H264_CODEC_ID } from './video-decoder.js';
import { CODEC_IDS, FrameError } from './wire.js';

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

const DECODERS = {
  [CODEC_IDS.raw]: () => ({ decode: async (header, payload) => rawPicture(header, payload), close() {} }),
  [CODEC_IDS.jpeg]: () => ({ decode: jpegPicture, close() {} }),
  [H264_CODEC_ID]: createH264Decoder,  // WebCodecs; a VideoFrame draws like an ImageBitmap
};

/**
 * A decoder for frames whose header says `codecId`.
 * @returns {{decode(header: object, payload: Uint8Array): Promise<Picture>, close(): void}}
 */
export function createDecoder(codecId) {
  const make = DECODERS[codecId];
  if (!make) throw new FrameError(`frame codec id ${codecId} is not supported by this page`);
  return make();
}

export { h264Supported } from './video-decoder.js';
