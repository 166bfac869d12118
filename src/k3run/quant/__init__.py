"""ModelOpt checkpoint support: config parsing (modelopt), schemes, export."""

from __future__ import annotations

from k3run.quant.algo import QuantAlgo

__all__ = ["QuantAlgo"]
