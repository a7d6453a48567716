"""Decoders for Wan2.1 latents besides the full Wan VAE (shared by the Wan-latent models)."""
