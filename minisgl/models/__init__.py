"""Models in plain torch with Hugging Face config and weight names.

config.py (ModelConfig), layers.py and decoder.py (CausalLM), weight.py (checkpoint
loading), source.py (model folder or hub id), gguf.py and default_model.py (the embedded
default model). Import from the submodules: this package imports nothing itself, so the
API server can resolve a model without importing torch.
"""
