"""Attention: exact reference, FlashInfer wrappers, prefix policies, step plans and decode attention."""
