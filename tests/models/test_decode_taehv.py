"""TAEHV for Wan2.1 latents: streamed chunk by chunk equals a dense whole-clip reference; the published layout loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from taehv_reference import decode_clip, reference_decoder

from arstream.models.matrix_game.checkpoint import CheckpointError
from arstream.models.matrix_game.decoders import load_taehv
from arstream.models.wan_decoders.taehv import StreamingTAEHV, TAEHVDecoder, TAEHVShape

WIDTHS = (12, 8, 6, 4)


def _decoder(seed: int = 0) -> TAEHVDecoder:
    torch.manual_seed(seed)
    module = TAEHVDecoder(TAEHVShape(widths=WIDTHS)).eval()
    # default init gives near-constant frames; larger weights make every memory block matter
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(2.0)
    return module


def _reference(module: TAEHVDecoder) -> torch.nn.Module:
    ref = reference_decoder(WIDTHS)
    ref.load_state_dict(module.state_dict(), strict=True)  # same weights; the layouts must agree key for key
    return ref.eval()


def _latents(frames: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, frames, 16, 3, 5, generator=torch.Generator().manual_seed(seed)) * 2


def test_one_call_equals_the_dense_frame_by_frame_reference() -> None:
    module = _decoder()
    latents = _latents(7)
    with torch.no_grad():
        ours, _ = module.decode(latents, None)
    expected = decode_clip(_reference(module), latents)
    assert ours.shape == (1, 4 * 7 - 3, 3, 24, 40)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cuts", [(3, 3, 3, 3), (1, 4, 2, 5), (3, 1, 1, 1, 6)])
def test_streamed_chunks_equal_the_whole_clip(cuts: tuple[int, ...]) -> None:
    module = _decoder()
    latents = _latents(sum(cuts))
    expected = decode_clip(_reference(module), latents)
    state = None
    pieces, start = [], 0
    with torch.no_grad():
        for n in cuts:
            before: list[torch.Tensor] | None = None if state is None else [t.clone() for t in state]
            video, new_state = module.decode(latents[:, start : start + n], state)
            if state is not None and before is not None:  # the state given is never changed
                assert all(torch.equal(a, b) for a, b in zip(state, before))
            pieces.append(video)
            state, start = new_state, start + n
    streamed = torch.cat(pieces, 1)
    assert [p.shape[1] for p in pieces] == [4 * cuts[0] - 3, *(4 * n for n in cuts[1:])]
    torch.testing.assert_close(streamed, expected, atol=1e-5, rtol=1e-5)


def test_negative_control_a_chunk_decoded_without_its_state_differs() -> None:
    module = _decoder()
    latents = _latents(6)
    expected = decode_clip(_reference(module), latents)
    with torch.no_grad():
        _, state = module.decode(latents[:, :3], None)
        fresh = [torch.zeros_like(t) for t in state]  # memory of zeros instead of the first chunk's last frames
        second, _ = module.decode(latents[:, 3:], fresh)
    assert (second - expected[:, 9:]).abs().max() > 1e-3


def test_rows_with_their_own_states_decode_as_one_batch_like_alone() -> None:
    streaming = StreamingTAEHV(_decoder())
    a, b = _latents(3, seed=2), _latents(3, seed=3)
    wan = torch.cat([a, b]).permute(0, 2, 1, 3, 4)  # [B, 16, F, h, w]
    first, states = streaming.decode_rows(wan, [None, None])
    second, _ = streaming.decode_rows(wan, states)
    for row in range(2):
        alone_first, alone_state = streaming.decode(wan[row : row + 1], None)
        alone_second, _ = streaming.decode(wan[row : row + 1], alone_state)
        torch.testing.assert_close(first[row], alone_first, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(second[row], alone_second, atol=1e-6, rtol=1e-6)
    assert first[0].shape == (1, 3, 9, 24, 40) and second[0].min() >= -1 and second[0].max() <= 1


def _write_published_layout(path: Path, module: TAEHVDecoder, *, grow_frames: int = 1) -> None:
    """A tiny file with taew2_1.pth's key names: encoder keys beside the decoder's, as published."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    state["encoder.0.weight"] = torch.zeros(4, 3, 3, 3)
    state["encoder.0.bias"] = torch.zeros(4)
    if grow_frames > 1:  # a grow layer saved with more output frames keeps the last ones
        key = "decoder.7.conv.weight"
        state[key] = torch.cat([torch.randn_like(state[key]) for _ in range(grow_frames - 1)] + [state[key]])
    torch.save(state, path)


def test_the_published_layout_loads_with_its_widths_read_from_the_file(tmp_path: Path) -> None:
    module = _decoder(seed=5)
    path = tmp_path / "taew2_1.pth"
    _write_published_layout(path, module, grow_frames=2)
    loaded = load_taehv(path)
    assert loaded.shape.widths == WIDTHS
    latents = _latents(3)
    with torch.no_grad():
        np.testing.assert_array_equal(loaded.decode(latents, None)[0].numpy(), module.decode(latents, None)[0].numpy())


def test_the_full_size_layout_has_the_published_shapes() -> None:
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in TAEHVDecoder().state_dict().items()}
    assert shapes["decoder.1.weight"] == (256, 16, 3, 3)
    assert shapes["decoder.3.conv.0.weight"] == (256, 512, 3, 3)
    assert shapes["decoder.7.conv.weight"] == (256, 256, 1, 1)
    assert shapes["decoder.13.conv.weight"] == (256, 128, 1, 1)
    assert shapes["decoder.19.conv.weight"] == (128, 64, 1, 1)
    assert shapes["decoder.22.weight"] == (3, 64, 3, 3)
    assert not any(".skip." in k for k in shapes)  # every memory block keeps its width: no skip convolution


def test_a_file_that_does_not_fit_names_the_file_and_keys(tmp_path: Path) -> None:
    module = _decoder()
    state = module.state_dict()
    broken = tmp_path / "taew2_1.pth"
    torch.save({k: v for k, v in state.items() if k != "decoder.4.conv.2.weight"}, broken)
    with pytest.raises(CheckpointError, match=r"taew2_1.pth does not fit the model: missing keys: decoder.4.conv.2.weight"):
        load_taehv(broken)
    other = tmp_path / "taew2_2.pth"
    torch.save({**state, "decoder.1.weight": torch.zeros(12, 48, 3, 3)}, other)
    with pytest.raises(CheckpointError, match="48-channel latents"):
        load_taehv(other)
    encoder_only = tmp_path / "enc.pth"
    torch.save({"encoder.0.weight": torch.zeros(1)}, encoder_only)
    with pytest.raises(CheckpointError, match="not a TAEHV decoder"):
        load_taehv(encoder_only)
    garbage = tmp_path / "junk.pth"
    garbage.write_bytes(b"not a file")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_taehv(garbage)
