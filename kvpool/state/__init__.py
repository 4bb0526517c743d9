"""A llama.cpp sequence state read into cells and per-layer K/V, written back, and re-sliced across layer ranges."""
