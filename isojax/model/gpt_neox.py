"""The old name of the one trunk (isojax.model.decoder.Decoder), kept while isojax.device.runner
imports it; delete once that import names Decoder."""

from isojax.model.decoder import Decoder as GPTNeoX  # noqa: F401
