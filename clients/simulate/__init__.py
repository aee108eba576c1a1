"""``kvindex simulate``: every routing policy over a fresh simulated fleet (run.py); the
discrete-event fleet and its time model (fleet.py); the routers, among them the real
Scorer fed by the real indexer pipeline, and the oracle (routing.py)."""
