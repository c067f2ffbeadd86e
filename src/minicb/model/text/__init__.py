"""Text in and out: the tokenizer (with incremental detokenizing) and the chat template."""
