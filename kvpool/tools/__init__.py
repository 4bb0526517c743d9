"""Tools the product does not run: generators of test and benchmark inputs (synthetic.py: random-weight llama
GGUFs of other shapes and quantizations, made with gguf-py and llama.cpp's own quantizer)."""
