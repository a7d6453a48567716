"""The Wan2.1 pieces two model families share: DiT layers, rotary table, few-step sampler, streaming VAE, loaders.

matrix-game-2 (:mod:`arstream.models.matrix_game`) and LongLive
(:mod:`arstream.models.longlive`) are both causal Wan2.1 DiTs; what differs
(action modules and image context, or text context and prompt switches) stays
in their own packages.
"""
