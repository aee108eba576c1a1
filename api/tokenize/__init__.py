"""Text and chat messages → token ids, per model: a local ``tokenizer.json`` with its chat
template, or a replica's ``/tokenize`` (failing over between replicas in the proxy)."""
