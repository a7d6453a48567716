"""The ``weights`` model option's quantization lives in :mod:`arstream.models.quantize` (every model's, not only
Wan's); these names stay importable from here."""

from ..quantize import WEIGHTS, QuantizationUnavailable, check_weights_option, quantize_blocks

__all__ = ["WEIGHTS", "QuantizationUnavailable", "check_weights_option", "quantize_blocks"]
