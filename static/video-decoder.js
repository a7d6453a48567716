// H.264 frames (ARF1 codec id 2, docs/PROTOCOL.md) decoded with WebCodecs.
//
// Self-contained: it needs nothing from the other modules. The server sends one
// H.264 access unit per binary frame message (Annex B: start codes, SPS and PPS
// in front of every keyframe), Constrained Baseline, no B-frames, so frames
// come out of the decoder in the order they went in. A stream begins with a
// keyframe (a session's start, reset or resume); this decoder reads the
// profile and level from that keyframe's SPS to configure WebCodecs.
//
// decode.js plugs it into the demo page (codec id 2), and the page offers
// H.264 in its codec menu when `await h264Supported()`.
// decode() returns the same {source, close()} picture as the other decoders;
// `source` is a VideoFrame, which canvas drawImage takes like an ImageBitmap.

const NAL_IDR = 5;
const NAL_SPS = 7;

export class VideoDecodeError extends Error {}

/** NAL unit types and bodies of an Annex B access unit, in order. */
export function nalUnits(payload) {
  const units = [];
  let start = -1;
  for (let i = 0; i + 2 < payload.length; i++) {
    if (payload[i] === 0 && payload[i + 1] === 0 && payload[i + 2] === 1) {
      if (start >= 0) units.push(payload.subarray(start, i > 0 && payload[i - 1] === 0 ? i - 1 : i));
      start = i + 3;
      i += 2;
    }
  }
  if (start >= 0 && start < payload.length) units.push(payload.subarray(start));
  return units.map((body) => ({ type: body[0] & 0x1f, body }));
}

/** Whether the access unit holds an IDR picture (a stream can begin here). */
export function isKeyframe(payload) {
  return nalUnits(payload).some((unit) => unit.type === NAL_IDR);
}

/** The WebCodecs codec string (`avc1.PPCCLL`) from the access unit's SPS, or null without one. */
export function avcCodecString(payload) {
  const sps = nalUnits(payload).find((unit) => unit.type === NAL_SPS);
  if (!sps || sps.body.length < 4) return null;
  const hex = (byte) => byte.toString(16).padStart(2, '0').toUpperCase();
  return `avc1.${hex(sps.body[1])}${hex(sps.body[2])}${hex(sps.body[3])}`;
}

/** Whether this browser decodes the server's H.264 (WebCodecs, secure context). */
export async function h264Supported() {
  if (typeof VideoDecoder === 'undefined') return false;
  try {
    const { supported } = await VideoDecoder.isConfigSupported({ codec: 'avc1.42E01E', optimizeForLatency: true });
    return Boolean(supported);
  } catch {
    return false;
  }
}

/**
 * One session's H.264 decoder.
 * @returns {{decode(header: {width: number, height: number}, payload: Uint8Array):
 *            Promise<{source: VideoFrame, close(): void}>, close(): void}}
 */
export function createH264Decoder() {
  let decoder = null;
  let codec = null;
  let timestamp = 0;
  const waiting = [];  // one {resolve, reject, header} per frame handed to the decoder, in order

  const failAll = (error) => {
    while (waiting.length) waiting.shift().reject(error);
  };

  const output = (frame) => {
    const next = waiting.shift();
    if (!next) {
      frame.close();
      return;
    }
    const { width, height } = next.header;
    let picture = frame;
    if (frame.codedWidth !== width || frame.codedHeight !== height) {
      // Odd sizes travel padded to even ones: show only the header's size.
      picture = new VideoFrame(frame, { visibleRect: { x: 0, y: 0, width, height } });
      frame.close();
    }
    next.resolve({ source: picture, close: () => picture.close() });
  };

  const configure = (newCodec) => {
    if (decoder && decoder.state !== 'closed') decoder.close();
    failAll(new VideoDecodeError('the H.264 stream restarted before these frames were decoded'));
    decoder = new VideoDecoder({
      output,
      error: (error) => failAll(new VideoDecodeError(`H.264 decoding failed: ${error.message}`)),
    });
    decoder.configure({ codec: newCodec, optimizeForLatency: true });
    codec = newCodec;
  };

  return {
    decode(header, payload) {
      const key = isKeyframe(payload);
      if (key) {
        const streamCodec = avcCodecString(payload);
        if (!streamCodec) return Promise.reject(new VideoDecodeError('an H.264 keyframe without its SPS'));
        // A new stream (start, reset, resume) or a closed decoder: start over from this keyframe.
        if (streamCodec !== codec || !decoder || decoder.state === 'closed') configure(streamCodec);
      } else if (!decoder || decoder.state !== 'configured') {
        return Promise.reject(new VideoDecodeError('an H.264 stream must begin with a keyframe'));
      }
      return new Promise((resolve, reject) => {
        waiting.push({ resolve, reject, header });
        decoder.decode(new EncodedVideoChunk({ type: key ? 'key' : 'delta', timestamp: timestamp++, data: payload }));
      });
    },
    close() {
      failAll(new VideoDecodeError('the decoder was closed'));
      if (decoder && decoder.state !== 'closed') decoder.close();
      decoder = null;
      codec = null;
    },
  };
}
