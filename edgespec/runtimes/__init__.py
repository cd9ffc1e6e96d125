"""ONNX Runtime sessions, execution providers and KV buffers."""

from edgespec.runtimes.decoder import DecoderSession, KVCache
from edgespec.runtimes.providers import DEVICES, resolve_providers

__all__ = ["DEVICES", "DecoderSession", "KVCache", "resolve_providers"]
