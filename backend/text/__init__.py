"""Text in and out (DESIGN.md §2 steps 4 and 7): tokenizers, chat templates, the detokenizer, the
reasoning and tool-call parsers, and constrained decoding (structured output)."""
