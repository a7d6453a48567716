"""A fake of ``vllm_omni.diffusion.utils.media_utils``: the one library function vLLM-Omni's example client imports.

The client calls ``finalize_streaming_video_bytes`` after ``session.done`` to
turn the streamed fMP4 into a progressive MP4 for local players. vLLM-Omni's
own (0.30.0) decodes every frame of the stream and muxes them again with
libx264; this fake does the same with PyAV, so the client runs unchanged
without vLLM-Omni (and vLLM) installed. Unlike the library it raises when the
stream does not decode, so a broken stream fails the test instead of being
saved as it came.
"""

from __future__ import annotations

import io
from fractions import Fraction

import av


def finalize_streaming_video_bytes(
    video_bytes: bytes, *, input_format: str, fps: float = 25.0, video_codec_options: dict[str, str] | None = None
) -> bytes:
    if input_format.lower() != "m4s":
        raise ValueError(f"Unsupported streaming video format: {input_format}")
    with av.open(io.BytesIO(video_bytes), format="mp4") as source:
        frames = [frame.to_ndarray(format="rgb24") for frame in source.decode(video=0)]
    if not frames:
        raise ValueError("the streamed bytes hold no video frames")
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as target:
        stream = target.add_stream("libx264", rate=Fraction(fps).limit_denominator(10000))
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", **(video_codec_options or {})}
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                target.mux(packet)
        for packet in stream.encode():
            target.mux(packet)
    return out.getvalue()
