"""The ``weights`` model option's quantization lives in :mod:`arstream.models.quantize` (every model's, not only
Wan's), with torchao's quieted import; these names stay importable from here."""

from ..quantize import WEIGHTS, QuantizationUnavailable, check_weights_option, quantize_blocks, quiet_torchao_import

__all__ = ["WEIGHTS", "QuantizationUnavailable", "check_weights_option", "quantize_blocks", "quiet_torchao_import"]
