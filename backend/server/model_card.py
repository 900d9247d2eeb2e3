"""What the serving layer knows about the one checkpoint a backend serves, read once at start.

Everything here is text-side: tokenizer, chat template, stop tokens, the family's markers, and the
`ModelCard` the gateway's catalog checks. The weights and the engine live elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from backend.models.model_config import ModelConfig
from backend.text.chat_template import ChatTemplate
from backend.text.reasoning import ThinkMarkers
from backend.text.tokenizer import Tokenizer, load_tokenizer
from backend.text.tool_parsers import MARKERS as TOOL_MARKERS_OF
from schemas.backend import Capabilities, ModelCard

# turn-ending tokens of each family's chat format (`engine-anchors.md` §1i, §9)
STOP_TOKENS = {"kimi": ("<|im_end|>", "[EOS]"), "glm": ("<|endoftext|>", "<|user|>", "<|observation|>")}
TOOL_MARKERS = (*TOOL_MARKERS_OF["kimi"], *TOOL_MARKERS_OF["glm"])  # every family's, for `marker_ids`


def family_of(config: ModelConfig) -> str:
    """`kimi` for the DeepSeek-V3 / Kimi K2 graph, `glm` for the GLM ones."""
    return "glm" if config.architecture.startswith("Glm") else "kimi"


def weights_format(model_dir: Path, dtype: str) -> str:
    """`int4-w4a16` / `fp8` when config.json declares a quantization, else the serving dtype."""
    from backend.quant.walker import read_scheme

    scheme = read_scheme(model_dir)  # compressed-tensors `float-quantized` is FP8, not INT4
    if scheme is None:
        return dtype
    return "int4-w4a16" if scheme.method == "int4" else "fp8"


@dataclass(slots=True)
class ServedModel:
    name: str
    path: Path
    config: ModelConfig
    family: str
    tokenizer: Tokenizer
    template: ChatTemplate | None
    eos_token_ids: list[int]
    think: ThinkMarkers | None
    marker_ids: dict[str, int | None]
    context_window: int
    has_vision: bool = False

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        name: str | None = None,
        context_window: int | None = None,
        has_vision: bool = False,
    ) -> ServedModel:
        folder = Path(path)
        config = ModelConfig.from_pretrained(folder)
        tokenizer = load_tokenizer(folder)
        family = family_of(config)
        eos: list[int] = list(config.eos_token_ids)
        for token_id in [tokenizer.named_id("eos_token")] + [
            tokenizer.token_to_id(t) for t in STOP_TOKENS[family]
        ]:
            if token_id is not None and token_id not in eos:
                eos.append(token_id)
        return cls(
            name=name or folder.name,
            path=folder,
            config=config,
            family=family,
            tokenizer=tokenizer,
            template=ChatTemplate.from_checkpoint(folder),
            eos_token_ids=eos,
            think=ThinkMarkers.of(tokenizer),
            marker_ids={m: tokenizer.token_to_id(m) for m in TOOL_MARKERS},
            context_window=context_window or config.max_position_embeddings,
            has_vision=has_vision,
        )

    def card(self, *, dtype: str, kv_dtype: str, page_size: int, num_pages: int) -> ModelCard:
        has_tools = all(self.marker_ids[m] is not None for m in TOOL_MARKERS_OF[self.family])
        return ModelCard(
            name=self.name,
            architecture=self.config.architecture,
            family="glm" if self.family == "glm" else "kimi",
            weights=weights_format(self.path, dtype),
            kv_dtype=kv_dtype,
            context_window=self.context_window,
            page_size=page_size,
            num_pages=num_pages,
            capabilities=Capabilities(
                vision=self.has_vision, tools=has_tools, reasoning=self.think is not None, json_mode=True
            ),
        )
