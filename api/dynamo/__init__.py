"""Dynamo's standalone-indexer HTTP API (``ai-dynamo-runtime``'s ``python -m dynamo.indexer``)
over kvindex's registry and index: its bodies, its instance ids, its answers."""
