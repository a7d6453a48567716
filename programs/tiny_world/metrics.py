"""Quality measures for generated (or rendered) frames: motion, colour drift, contrast.

* :func:`phase_correlation_shift`: the global content shift between two frames.
* :func:`responsiveness`: how often consecutive frames move the way the held keys say.
* :func:`color_histogram` / :func:`total_variation`: colour drift between two stretches.
* :func:`frame_stats`: contrast, pixel noise and palette adherence, to tell a
  healthy frame from a collapse to grey, noise or a frozen pattern.
* :func:`picture_quality` (palette share, class coherence, grid peak, class
  shares against the map's) and :func:`idle_change`: whether frames look like
  the world (smooth shapes in its five flat colours) and stay put when the
  camera does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ...models.tiny_world.world import CLASS_SHARES, PALETTE, velocity

MIN_SHIFT_PX = 0.5


def _luma(frame: np.ndarray) -> np.ndarray:
    return frame.astype(np.float64) @ np.array([0.299, 0.587, 0.114])


def _subpixel(left: float, centre: float, right: float) -> float:
    denom = left - 2 * centre + right
    return 0.0 if denom == 0 else 0.5 * (left - right) / denom


def phase_correlation_shift(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """``(dx, dy)`` by which content moved on screen from frame ``a`` to frame ``b`` (pixels).

    Positive ``dx`` means content moved right, positive ``dy`` down. Frames are
    ``[H, W, 3]`` uint8; a Hann window keeps the crop edges from dominating.
    """
    la, lb = _luma(a), _luma(b)
    h, w = la.shape
    window = np.outer(np.hanning(h), np.hanning(w))
    fa = np.fft.fft2((la - la.mean()) * window)
    fb = np.fft.fft2((lb - lb.mean()) * window)
    cross = fb * np.conj(fa)
    cross /= np.maximum(np.abs(cross), 1e-9)
    corr = np.fft.ifft2(cross).real
    py, px = np.unravel_index(int(np.argmax(corr)), corr.shape)
    dy = py + _subpixel(corr[(py - 1) % h, px], corr[py, px], corr[(py + 1) % h, px])
    dx = px + _subpixel(corr[py, (px - 1) % w], corr[py, px], corr[py, (px + 1) % w])
    dy = dy - h if dy > h / 2 else dy
    dx = dx - w if dx > w / 2 else dx
    return float(dx), float(dy)


def expected_content_motion(keys: Iterable[str]) -> tuple[int, int]:
    """On-screen content motion per frame for held keys (the camera's opposite)."""
    dx, dy = velocity(keys)
    return -dx, -dy


def shifts(frames: np.ndarray) -> np.ndarray:
    """``[N - 1, 2]`` content shifts between consecutive frames."""
    return np.array([phase_correlation_shift(frames[i], frames[i + 1]) for i in range(len(frames) - 1)])


def responsiveness(frames: np.ndarray, keys: Sequence[str]) -> dict[str, float]:
    """With ``keys`` held throughout: share of frame pairs moving the right way by >= 0.5 px.

    "The right way" is the measured shift projected on the expected direction.
    With no key held the figure of merit is the mean shift magnitude instead.
    """
    s = shifts(frames)
    magnitude = np.hypot(s[:, 0], s[:, 1])
    ex, ey = expected_content_motion(keys)
    norm = float(np.hypot(ex, ey))
    result = {"pairs": float(len(s)), "mean_dx": float(s[:, 0].mean()), "mean_dy": float(s[:, 1].mean())}
    result["mean_shift"] = float(magnitude.mean())
    if norm > 0:
        along = (s[:, 0] * ex + s[:, 1] * ey) / norm
        result["fraction_right_way"] = float((along >= MIN_SHIFT_PX).mean())
        result["mean_along"] = float(along.mean())
    return result


def color_histogram(frames: np.ndarray, bins: int = 8) -> np.ndarray:
    """Normalised ``bins**3`` RGB histogram over all pixels of ``frames`` ``[..., 3]`` uint8."""
    q = (frames.reshape(-1, 3).astype(np.int64) * bins) // 256
    index = (q[:, 0] * bins + q[:, 1]) * bins + q[:, 2]
    hist = np.bincount(index, minlength=bins**3).astype(np.float64)
    return hist / hist.sum()


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return float(0.5 * np.abs(p - q).sum())


def palette_fraction(frames: np.ndarray, tolerance: float = 40.0) -> float:
    """Share of pixels within ``tolerance`` (RGB distance) of a world palette colour."""
    px = frames.reshape(-1, 3).astype(np.float64)
    dist = np.linalg.norm(px[:, None, :] - PALETTE[None].astype(np.float64), axis=-1).min(axis=1)
    return float((dist <= tolerance).mean())


def frame_stats(frames: np.ndarray) -> dict[str, float]:
    """Mean per-frame contrast (luma std), pixel noise (mean |neighbour difference|), palette share."""
    luma = np.stack([_luma(f) for f in frames])
    contrast = luma.reshape(len(frames), -1).std(axis=1)
    noise = 0.5 * (np.abs(np.diff(luma, axis=1)).mean(axis=(1, 2)) + np.abs(np.diff(luma, axis=2)).mean(axis=(1, 2)))
    return {
        "contrast": float(contrast.mean()),
        "min_contrast": float(contrast.min()),
        "pixel_noise": float(noise.mean()),
        "palette_fraction": palette_fraction(frames),
    }


def drift_report(frames: np.ndarray, moving: bool = True) -> dict[str, float]:
    """Compare the first and last quarter of a rollout: histogram TV, contrast, noise, motion."""
    n = len(frames) // 4
    first, last = frames[:n], frames[-n:]
    tv = total_variation(color_histogram(first), color_histogram(last))
    a, b = frame_stats(first), frame_stats(last)
    report = {"tv_first_last_quarter": tv, "frames": float(len(frames))}
    report.update({f"first_{k}": v for k, v in a.items()})
    report.update({f"last_{k}": v for k, v in b.items()})
    if moving:
        s = shifts(last)
        report["last_mean_shift"] = float(np.hypot(s[:, 0], s[:, 1]).mean())
    return report


# ---- picture quality: does a generated frame look like the world? -----------------------------
#
# Per 64x64 frame, averaged over frames unless said otherwise; a pixel's class is the nearest of the
# five palette colours in RGB. Ground truth scores 1.0 / ~0.92 / ~1.4 / ~0.05 / 0 on these.

GRID_PERIOD = 8  # the network's patch size: a mosaic of cells shows as gradient peaks at one phase


def pixel_classes(frames: np.ndarray) -> np.ndarray:
    """Nearest palette class (0..4) of every pixel of ``frames`` ``[..., 3]`` uint8."""
    return _palette_distances(frames).argmin(axis=0)


def _palette_distances(frames: np.ndarray) -> np.ndarray:
    """Squared RGB distance of every pixel to each palette colour: ``[5, ...]`` (one colour at a time: small)."""
    px = frames.astype(np.int32)
    return np.stack([((px - colour.astype(np.int32)) ** 2).sum(-1) for colour in PALETTE])


def coherence(frames: np.ndarray) -> float:
    """Share of horizontally and vertically adjacent pixel pairs whose classes agree, mean over frames."""
    return float(_coherence_per_frame(pixel_classes(frames)).mean())


def _coherence_per_frame(classes: np.ndarray) -> np.ndarray:
    n = len(classes)
    same_x = (classes[:, :, 1:] == classes[:, :, :-1]).reshape(n, -1)
    same_y = (classes[:, 1:, :] == classes[:, :-1, :]).reshape(n, -1)
    return np.concatenate([same_x, same_y], axis=1).mean(axis=1)


def grid_peaks(frames: np.ndarray, period: int = GRID_PERIOD) -> np.ndarray:
    """Per frame: mean |gradient| of the grey image grouped by position mod ``period``, largest over median.

    The frame's figure is the mean of the x and y ratios; a frame with no
    gradient at all along an axis (one flat colour) has none (NaN), one
    whose steps all fall at one phase an infinite one.
    """
    peaks = np.full(len(frames), np.nan)
    for i, frame in enumerate(frames):
        luma = _luma(frame)
        ratios = []
        for grad in (np.abs(np.diff(luma, axis=1)), np.abs(np.diff(luma, axis=0)).T):
            # column j of grad is the step between pixel j and j + 1
            groups = np.array([grad[:, phase::period].mean() for phase in range(period)])
            median, peak = float(np.median(groups)), float(groups.max())
            # every step at one phase (a perfect mosaic) peaks without bound; no step at all has no figure
            ratios.append(peak / median if median > 0 else (np.inf if peak > 0 else np.nan))
        peaks[i] = np.mean(ratios)
    return peaks


def grid_peak(frames: np.ndarray, period: int = GRID_PERIOD) -> float:
    """Median over frames of :func:`grid_peaks` (frames without a figure left out)."""
    peaks = grid_peaks(frames, period)
    return float(np.nanmedian(peaks)) if not np.isnan(peaks).all() else float("nan")


def class_shares(frames: np.ndarray) -> np.ndarray:
    """Share of all pixels of ``frames`` in each palette class."""
    counts = np.bincount(pixel_classes(frames).ravel(), minlength=len(PALETTE))
    return counts / counts.sum()


def class_tv(frames: np.ndarray) -> float:
    """Total variation between the frames' class shares and the world map's."""
    return total_variation(class_shares(frames), np.array(CLASS_SHARES))


def idle_change(frames: np.ndarray, release: int, settle: int = 8, span: int = 64) -> float:
    """Share of pixels whose class differs between frame ``release + settle`` and ``span`` frames later.

    ``frames`` is a rollout whose camera stops (no key held) from frame
    ``release`` on; a world model should keep what it shows while it stands still.
    """
    first, last = release + settle, release + settle + span
    if last >= len(frames):
        raise ValueError(f"idle_change needs {last + 1} frames, got {len(frames)}")
    return float((pixel_classes(frames[first]) != pixel_classes(frames[last])).mean())


def picture_quality(rollouts: Iterable[np.ndarray], tolerance: float = 40.0) -> dict[str, Any]:
    """palette_share, coherence, grid_peak and class_tv over every frame of several rollouts.

    The same figures as :func:`palette_fraction`, :func:`coherence`,
    :func:`grid_peak` and :func:`class_tv` on all frames stacked together,
    computed a slice at a time so long evaluations stay small in memory.
    """
    on_palette, coherent, frames_seen = 0, 0.0, 0
    counts = np.zeros(len(PALETTE), dtype=np.int64)
    peaks = []
    for frames in rollouts:
        for start in range(0, len(frames), 64):
            part = frames[start : start + 64]
            dist = _palette_distances(part)
            classes = dist.argmin(axis=0)
            on_palette += int((dist.min(axis=0) <= tolerance**2).sum())
            coherent += float(_coherence_per_frame(classes).sum())
            counts += np.bincount(classes.ravel(), minlength=len(PALETTE))
            peaks.append(grid_peaks(part))
            frames_seen += len(part)
    all_peaks = np.concatenate(peaks)
    return {
        "palette_share": float(on_palette / counts.sum()),
        "coherence": coherent / frames_seen,
        "grid_peak": float(np.nanmedian(all_peaks)) if not np.isnan(all_peaks).all() else float("nan"),
        "class_tv": total_variation(counts / counts.sum(), np.array(CLASS_SHARES)),
        # water, sand, grass, forest, rock: what class_tv compares with the map's shares
        "class_shares": [round(float(share), 4) for share in counts / counts.sum()],
    }
