"""Layers shared by every model family: norms, rotary embeddings, sharded linears, MoE."""
