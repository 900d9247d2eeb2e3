"""Speculative decoding with MTP drafts: plan, verify, accept, propose (`decoder.SpecDecoder` runs a step)."""
