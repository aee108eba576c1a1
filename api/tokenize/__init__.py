"""Text and chat messages → token ids, per model: a local ``tokenizer.json`` or a replica's."""
