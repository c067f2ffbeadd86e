"""Weights in and out: the GGUF reader, the Hugging Face directory reader, ``load_model`` (either, by
path) and ``export_hf`` (a GGUF written back as a Hugging Face directory for peers and oracles)."""
