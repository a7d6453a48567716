"""longlive: LongLive (the Self-Forcing family), a prompt-driven causal Wan2.1 T2V model, with prompt switches."""
