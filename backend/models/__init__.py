"""Model architectures, by the name a checkpoint's config.json gives in `architectures[0]`.

The contract every architecture class keeps (the engine and loader code against it):

    class SomeArch(torch.nn.Module):
        def __init__(self, config: ModelConfig, *, dtype: torch.dtype, rank: int = 0, world_size: int = 1,
                     ep: int = 0, dcp: int = 1)
        def cache_specs(self) -> list[list[CacheSpec]]            # one list per layer (backend/engine/forward_batch.py)
        def forward(self, batch: ForwardBatch) -> torch.Tensor    # float32 logits [len(batch.logits_indices), vocab]
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None

`forward` embeds `batch.input_ids` (replacing the rows of `batch.image_embeds` when given), runs the
layers, writes each layer's new KV into `batch.kv_cache` at `batch.slot_mapping` through
`kernels.kv_write.kv_write_ref` (a token whose destination page lacks its expected tag is not
written), attends through the paged reference ops in `kernels/` (every page read is tag-checked; a
mismatching page contributes nothing), and sets `batch.tag_mismatch[b]` for any sequence b that met a
wrong tag: the engine must then abort b. Every op is given `batch.check_tags`; when it is False
(`EngineConfig.check_page_tags`, only to measure the check) no tag is read. With an FP8 cache, values are stored as value / scale with
the scales of `kv_cache.scales[layer][name]`. `rank` / `world_size` pick this rank's slice of the
weights (attention heads and dense MLPs split tensor-parallel, routed experts over `ep` expert
groups, embedding and lm_head by vocabulary rows; `dcp` ranks share one MLA latent cache by token,
and then each rank writes and reads only its own tokens, finding their slots from the page table —
`batch.slot_mapping` is not read): backend/models/layers/parallel.py and context_parallel.py. The logits
come back whole on every rank; `batch.tag_mismatch` holds this rank's findings only (the runtime
OR-reduces it over the ranks). On one rank no collective runs.
"""

from __future__ import annotations

from torch import nn

from backend.models.deepseek_v3 import DeepseekV3ForCausalLM
from backend.models.glm4_moe import Glm4MoeForCausalLM
from backend.models.glm_moe_dsa import GlmMoeDsaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    # Kimi K2.5 / K2.6: the text model (the vision tower is backend/models/moonvit.py); the published
    # checkpoints name it KimiK25…, transformers writes Kimi_K25…
    "KimiK25ForConditionalGeneration": DeepseekV3ForCausalLM,
    "Kimi_K25ForConditionalGeneration": DeepseekV3ForCausalLM,
}
