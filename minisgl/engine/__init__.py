"""The engine: model + KV cache + one forward step (no requests, no messages).

config.py (EngineConfig, no torch import), engine.py (Engine), sample.py (Sampler).
Import from the submodules, so that reading the configuration does not import torch.
"""
