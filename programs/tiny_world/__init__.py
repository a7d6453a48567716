"""Tools for tiny-world (the model lives in :mod:`arstream.models.tiny_world`): training, its decoder's
training, and evaluation (responsiveness, drift, picture quality)."""
