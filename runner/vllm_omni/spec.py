"""One KV spec, two runtimes: ARStream's :class:`KVCacheSpec` as vLLM-Omni's ``ARDiffusionKVCacheSpec``.

Both specs count the window the same way: a chunk attends to the sink frames
plus the last ``window_frames`` frames *including itself*. So the numbers
carry over one to one (``frames_per_chunk`` is vLLM-Omni's
``frames_per_block``) and the same spec gives the same attention span on both
runtimes; the conformance suite checks that by comparing the K/V each pass
sees.

What the two runtimes do differently with the same numbers is memory (see
docs/vllm-omni.md, "Capacity"): between chunks vLLM-Omni keeps
``sink + window`` blocks per session and branch, of which the next chunk sees
``sink + window - frames_per_chunk``; ARStream keeps only the ones the next
chunk sees, and instead reserves a staging row of ``sink + window`` frames for
the forward. :func:`omni_session_capacity` restates vLLM-Omni's sizing so tests
and docs can compare the two from one budget.
"""

from __future__ import annotations

import torch

from ..spec import KVBranch, KVCacheSpec
from ..types import UnsupportedConfiguration
from .deprecations import importing_vllm

with importing_vllm():
    from vllm_omni.experimental.ar_diffusion.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec


def to_omni_spec(spec: KVCacheSpec) -> ARDiffusionKVCacheSpec:
    """The same KV geometry and session policy in vLLM-Omni's terms."""
    if spec.cross_attention_lengths:
        # vLLM-Omni populates cross-attention through its own API (populate/read per branch);
        # ARStream's cross_kv views have no counterpart in the adapter yet.
        raise UnsupportedConfiguration(
            "the vllm-omni runtime does not adapt cross-attention caches yet; "
            f"this spec declares {sorted(spec.cross_attention_lengths)}"
        )
    if spec.history_rewrites or spec.model_owned_bytes_fixed or spec.model_owned_bytes_per_forward_row:
        # vLLM-Omni's spec has no term for them: its capacity would count too many sessions (LongLive's prompts)
        raise UnsupportedConfiguration(
            "the vllm-omni runtime cannot count history rewrites or shared model-owned state yet "
            "(history_rewrites, model_owned_bytes_fixed, model_owned_bytes_per_forward_row): use --runtime arstream"
        )
    if spec.strided_window_frames:
        # vLLM-Omni keeps one contiguous window per session: it would keep (and show the model) every frame of the
        # strided window, not the ones the spec names, and count its capacity for all of them
        raise UnsupportedConfiguration(
            "the vllm-omni runtime keeps one contiguous window and cannot keep a strided window "
            f"(strided_window_frames={spec.strided_window_frames}, frame_stride={spec.frame_stride}): "
            "use --runtime arstream"
        )
    return ARDiffusionKVCacheSpec(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        tokens_per_frame=spec.tokens_per_frame,
        frames_per_block=spec.frames_per_chunk,
        window_frames=spec.window_frames,
        sink_frames=spec.sink_frames,
        kv_branches=tuple(ARDiffusionKVBranchSpec(b.name, b.local_index) for b in spec.kv_branches),
        session_capacity=spec.session_capacity,
        reset_at_boundary=spec.reset_at_boundary,
        model_owned_state_bytes_per_session=spec.model_owned_bytes_per_session,
    )


def from_omni_spec(omni: ARDiffusionKVCacheSpec, dtype: torch.dtype) -> KVCacheSpec:
    """A vLLM-Omni pipeline's spec in ARStream's terms, for the server's stats and capacity figures."""
    return KVCacheSpec(
        num_layers=omni.num_layers,
        num_kv_heads=omni.num_kv_heads,
        head_size=omni.head_size,
        tokens_per_frame=omni.tokens_per_frame,
        frames_per_chunk=omni.frames_per_block,
        sink_frames=omni.sink_frames,
        window_frames=omni.window_frames,
        kv_branches=tuple(KVBranch(b.name, b.local_index) for b in omni.kv_branches),
        session_capacity=omni.session_capacity,
        cross_attention_lengths=dict(omni.cross_attention_lengths),
        model_owned_bytes_per_session=omni.model_owned_state_bytes_per_session,
        reset_at_boundary=omni.reset_at_boundary,
        dtype=dtype,
    )


def omni_resident_blocks(spec: KVCacheSpec, frames_committed: int) -> int:
    """Blocks vLLM-Omni keeps for one session, per branch, after ``frames_committed`` frames (sliding window)."""
    return min(frames_committed, spec.sink_frames + spec.window_frames)


def omni_session_bytes(spec: KVCacheSpec) -> int:
    """What one resident session costs vLLM-Omni: ``sink + window`` blocks per branch, cross-attention, model state."""
    resident = (spec.sink_frames + spec.window_frames) * len(spec.kv_branches) * spec.block_bytes
    return resident + spec.cross_attention_bytes_per_session + spec.model_owned_bytes_per_session


def omni_session_capacity(spec: KVCacheSpec, budget_bytes: int) -> int:
    """Resident sessions vLLM-Omni's KV cache admits from ``budget_bytes`` (0 when not even one fits).

    Its sizing (``ARDiffusionKVCache``, memory fraction 1): scratch of one
    chunk per branch, one in-flight chunk per branch, two blocks vLLM's block
    pool keeps for itself (the null block and one spare), and per resident
    session :func:`omni_session_bytes`.
    """
    branches = len(spec.kv_branches)
    fixed = (spec.frames_per_chunk * branches + spec.frames_per_chunk * branches + 2) * spec.block_bytes
    per_session = omni_session_bytes(spec)
    if budget_bytes < fixed + per_session:
        return 0
    return min(spec.session_capacity, (budget_bytes - fixed) // per_session)
