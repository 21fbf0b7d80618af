"""Attention: exact reference, FlashInfer wrappers, prefix backends and the per-step dispatcher."""
