"""kvindex write path: vLLM KV events → ordered, gap-aware ingestion → block index.

Rooms, each importing only from those before it: ``native`` (compiled loops), ``domain``, ``redis``,
``index``, ``fleet``, ``config``, ``ingest``; then the process (``service``, ``status_server``)."""
