"""The engine core (DESIGN.md §2 steps 5–7): requests in, sampled tokens out, one `step()` at a time.

Scheduler, block manager (pages + tags), page tables, prefix cache, sequences, the model runner with
its step planning, host staging and decode graphs, and the sampler; speculative decoding lives in
`speculative/`. The engine receives a prepared model and its KV scales
(`backend.models.loader.prepare_model`); it never imports `backend.quant`.
"""
