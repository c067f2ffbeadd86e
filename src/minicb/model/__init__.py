"""The model side: LLaMA on flat tokens, attention backends, weight and tokenizer loading."""
