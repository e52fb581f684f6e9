"""Training entry points built on `hf_tree_attn` (they need `trl` and `datasets`: `pip install .[train]`)."""
