"""The frame decoder: turns the transformer's clean-canvas estimate into a palette picture, frame by frame.

Real world models generate in a latent space and decode with a learned
decoder that makes the pixels coherent; video decoders such as Wan's VAE
are causal in time and carry what they decoded into the next frame. This is
the miniature of that step. The transformer's x0 estimate is blurry where it
is unsure (a mosaic of 8-px cells in washed-out colours); the decoder is a
small convolutional network, trained on world renders, that reads

* the transformer's estimate of the frame's canvas,
* the previous decoded canvas, moved into this canvas's world cells
  (canvases are world-aligned, so this is a whole-cell shift), and
* a mask of where that previous canvas exists (cells entering the canvas
  have no previous picture),

and predicts each pixel's class among the world's five colours. The frame is
the palette colour of the most likely class, so every pixel has a true
colour; it is what the viewer sees and what is committed to the KV history.
Where the previous picture exists, the decoder learns to keep it (the world
is static), so a camera standing still shows a still world; where cells
enter, it draws the transformer's invention as smooth shapes continuing the
ones beside them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .world import CLASS_SHARES, PALETTE

NUM_CLASSES = len(PALETTE)


def palette_canvas(device: torch.device | None = None) -> torch.Tensor:
    """The palette's colours ``[5, 3]`` in the model's [-1, 1] units."""
    return (torch.as_tensor(PALETTE, dtype=torch.float32, device=device) / 127.5) - 1


def nearest_class(canvas: torch.Tensor) -> torch.Tensor:
    """Each pixel's class (nearest palette colour) of ``[..., 3]`` canvases in [-1, 1]."""
    palette = palette_canvas(canvas.device)
    return ((canvas[..., None, :] - palette) ** 2).sum(-1).argmin(-1)


class ClassLogitsDecoder(nn.Module):
    """x0 estimate + previous canvas + mask -> class logits, at pixel resolution over a whole canvas.

    A U-shaped stack: full-resolution features, then a half-resolution body
    with dilated convolutions (receptive field about 30 px, so a shape's
    outline can be continued smoothly across the 8-px cells), upsampled and
    joined with the full-resolution features.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        c = channels
        self.inp = nn.Conv2d(3 + 3 + 1, c, 3, padding=1)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.body1 = nn.Conv2d(2 * c, 2 * c, 3, padding=2, dilation=2)
        self.body2 = nn.Conv2d(2 * c, 2 * c, 3, padding=4, dilation=4)
        self.up = nn.Conv2d(3 * c, c, 3, padding=1)
        self.out = nn.Conv2d(c, NUM_CLASSES, 1)

    def forward(self, estimate: torch.Tensor, previous: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``estimate``/``previous`` ``[N, C, C, 3]``, ``mask`` ``[N, C, C, 1]`` -> logits ``[N, C, C, 5]``."""
        x = torch.cat([estimate, previous * mask, mask], dim=-1).permute(0, 3, 1, 2)
        full = F.gelu(self.inp(x))
        half = F.gelu(self.down(full))
        half = half + F.gelu(self.body1(half))
        half = half + F.gelu(self.body2(half))
        up = F.interpolate(half, size=full.shape[-2:], mode="nearest")
        h = F.gelu(self.up(torch.cat([full, up], dim=1)))
        return self.out(h).permute(0, 2, 3, 1)


def align_previous(
    previous: torch.Tensor, previous_cells: torch.Tensor, cells: torch.Tensor, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's previous canvas into its new canvas's world cells.

    ``previous`` ``[B, C, C, 3]`` canvases whose corners are the world cells
    ``previous_cells`` ``[B, 2]`` (x, y); ``cells`` ``[B, 2]`` the new corners.
    Returns the shifted canvases and a ``[B, C, C, 1]`` mask, 0 where the new
    canvas reaches past the previous one (or the shift exceeds the canvas).
    """
    b, size = previous.shape[0], previous.shape[1]
    shifted = torch.zeros_like(previous)
    mask = torch.zeros(b, size, size, 1, dtype=previous.dtype, device=previous.device)
    shifts = ((cells - previous_cells) * patch_size).tolist()
    for row, (dx, dy) in enumerate(shifts):
        # new pixel (y, x) is previous pixel (y + dy, x + dx)
        if abs(dx) >= size or abs(dy) >= size:
            continue
        ys, ye = max(0, -dy), min(size, size - dy)
        xs, xe = max(0, -dx), min(size, size - dx)
        shifted[row, ys:ye, xs:xe] = previous[row, ys + dy : ye + dy, xs + dx : xe + dx]
        mask[row, ys:ye, xs:xe] = 1
    return shifted, mask


def blank_previous(cells: torch.Tensor, canvas_size: int, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """"No previous frame" for rows whose first canvas corners are ``cells`` ``[B, 2]``.

    A blank canvas placed beyond a canvas's reach, so :func:`align_previous`
    masks all of it: the first frame is decoded from the estimate alone.
    """
    far = canvas_size // patch_size + 1
    blank = torch.zeros(cells.shape[0], canvas_size, canvas_size, 3, device=cells.device)
    return blank, cells + far


def view_prior_logits(shifted: torch.Tensor, mask: torch.Tensor, strength: float) -> torch.Tensor:
    """Per-row logit offsets ``[B, 1, 1, K]`` that pull new content toward the map's class shares.

    ``-strength * log(share in view / share of the map)`` per class, the
    shares in view counted over the seen part of the canvas (``shifted`` where
    ``mask`` is 1) with one pseudo-count per class. A colour that fills the
    view already is drawn less where the view grows, one that is missing
    more: the world's mix holds at the scale of a view, as the map has it.
    """
    seen = F.one_hot(nearest_class(shifted), NUM_CLASSES).to(mask.dtype) * mask
    shares = (seen.sum((1, 2)) + 1) / (mask.sum((1, 2)) + NUM_CLASSES)
    target = torch.tensor(CLASS_SHARES, dtype=shares.dtype, device=shares.device)
    return (-strength * (shares / target).log())[:, None, None, :]


def window_mean_probabilities(logits: torch.Tensor, window: int) -> torch.Tensor:
    """Class probabilities of ``logits`` ``[B, C, C, K]`` averaged over a ``window`` x ``window`` neighbourhood.

    Near the canvas border only the pixels inside count. Floored above zero, so the log is finite.
    """
    probabilities = logits.softmax(-1).permute(0, 3, 1, 2)
    mean = F.avg_pool2d(probabilities, window, stride=1, padding=window // 2, count_include_pad=False)
    return mean.permute(0, 2, 3, 1).clamp_min(1e-6)


def decode_chunk(
    decoder: ClassLogitsDecoder,
    estimates: torch.Tensor,
    cells: torch.Tensor,
    previous: torch.Tensor | None,
    previous_cells: torch.Tensor | None,
    patch_size: int,
    keep_logit: float = 0.0,
    class_bias: Sequence[float] = (),
    unseen_window: int = 0,
    view_prior: float = 0.0,
) -> torch.Tensor:
    """Decode a chunk's frames in order; returns palette canvases ``[B, F, C, C, 3]`` in [-1, 1].

    ``estimates`` ``[B, F, C, C, 3]`` the transformer's x0, ``cells``
    ``[B, F, 2]`` each canvas's corner; ``previous``/``previous_cells`` the
    last decoded canvas of each row and its corner, or None at the start of a
    rollout (rows without one in a batch that has some: :func:`blank_previous`).
    Frame ``f`` sees frame ``f - 1``'s decoded canvas. ``keep_logit`` is
    added to the logit of each pixel's previous class where the previous
    frame exists: a pixel the viewer has seen changes only where the decoder
    is that much surer of another class (the world is static).
    ``class_bias`` (one value per class, or empty) is added to the logits
    where it does not: the class prior of what the viewer has not seen yet,
    fitted by :func:`arstream.programs.tiny_world.train_decoder.calibrate`.
    ``unseen_window`` (odd, or 0 for none): where the previous frame does not
    reach, each pixel takes the most likely class of the probabilities averaged
    over that window around it (seen neighbours included), a spatial prior
    that the world is made of large regions: without it, the transformer's
    uncertain guesses at new content come out as speckle and 8-px blocks.
    ``view_prior`` (0: none) adds :func:`view_prior_logits` where the previous
    frame does not reach, before that averaging: larger regions alone let a
    walk drift into one colour.
    """
    palette = palette_canvas(estimates.device)
    bias = torch.tensor(class_bias, dtype=estimates.dtype, device=estimates.device) if class_bias else None
    if previous is None or previous_cells is None:
        previous, previous_cells = blank_previous(cells[:, 0], estimates.shape[2], patch_size)
    decoded = []
    for f in range(estimates.shape[1]):
        shifted, mask = align_previous(previous, previous_cells, cells[:, f], patch_size)
        logits = decoder(estimates[:, f], shifted, mask)
        if keep_logit:
            logits = logits + keep_logit * mask * F.one_hot(nearest_class(shifted), NUM_CLASSES)
        if bias is not None:
            logits = logits + (1 - mask) * bias
        # Canvases are world-aligned: new cells enter only when the camera crosses a cell border, so most
        # frames have nothing unseen and skip the two priors that shape it.
        has_unseen = (view_prior or unseen_window) and not bool(mask.all())
        if has_unseen and view_prior:
            logits = logits + (1 - mask) * view_prior_logits(shifted, mask, view_prior)
        if has_unseen and unseen_window:
            logits = torch.where(mask.bool(), logits, window_mean_probabilities(logits, unseen_window).log())
        previous = palette[logits.argmax(-1)]
        previous_cells = cells[:, f]
        decoded.append(previous)
    return torch.stack(decoded, dim=1)
