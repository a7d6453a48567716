// The ARF1 binary frame format (docs/PROTOCOL.md, "Binary frame"): a 20-byte
// little-endian header, then the payload. The server's twin is app/wire.py.

export const HEADER_BYTES = 20;
export const MAGIC = 'ARF1';
export const FLAG_LAST_IN_CHUNK = 0x01;
export class FrameError extends Error {}

/**
 * Splits one binary message into its header fields and payload (a view, not a copy).
 * @param {ArrayBuffer} buffer
 * @returns {{header: {codec: number, last: boolean, frameIndex: number, chunkIndex: number,
 *            tickId: number, width: number, height: number}, payload: Uint8Array}}
 */
export function parseFrame(buffer) {
  if (buffer.byteLength < HEADER_BYTES) {
    throw new FrameError(`a ${buffer.byteLength}-byte binary message is shorter than the ${HEADER_BYTES}-byte header`);
  }
  const view = new DataView(buffer);
  const magic = String.fromCharCode(...new Uint8Array(buffer, 0, 4));
  if (magic !== MAGIC) throw new FrameError(`bad frame magic ${JSON.stringify(magic)}`);
  return {
    header: {
      codec: view.getUint8(4),
      last: (view.getUint8(5) & FLAG_LAST_IN_CHUNK) !== 0,
      frameIndex: view.getUint16(6, true),
      chunkIndex: view.getUint32(8, true),
      tickId: view.getUint32(12, true),
      width: view.getUint16(16, true),
      height: view.getUint16(18, true),
    },
    payload: new Uint8Array(buffer, HEADER_BYTES),
  };
}
