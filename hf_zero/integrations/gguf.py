"""gguf's functions hf_zero swaps while transformers converts SmolLM2's GGUF (an entry in registry.py's PATCHES)."""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["gguf_read_once"]


@contextmanager
def gguf_read_once():
    """transformers reads the GGUF file anew for the tokenizer, the config and the weights (gguf.GGUFReader: ~5 s
    each here, most of it building the 49,152-token vocabulary's fields in Python), and builds gguf's tensor-name
    table anew for each of the model's ~400 modules (~7 s in all). Both are pure: the reader only reads the
    memory-mapped file, the table depends on the architecture and layer count only. Within the conversion each is
    built once: the conversion takes 12.7 s instead of 25.5 s here, and its folder is byte for byte the same
    (weights, tokenizer, config; compared 2026-11-26). tests/data/test_assets.py checks the sharing.

    Swaps gguf.GGUFReader and gguf.get_tensor_name_map (gguf 0.19.0, looked up at call time by transformers 5.23.0's
    GGUF loader) for the conversion's duration. Can go when transformers' GGUF loader opens a file once."""
    import functools

    import gguf as gguf_lib

    reader_class, name_map, readers = gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map, {}

    def shared_reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_class(path, *args, **kwargs)
        return readers[key]

    gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map = shared_reader, functools.lru_cache(name_map)
    try:
        yield
    finally:
        gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map = reader_class, name_map
