"""matrix-game-2: a Matrix-Game-2.0-class causal Wan world model (keyboard + mouse) on the paged runner."""
