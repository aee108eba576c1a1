"""``kvindex simulate``: every policy over a simulated fleet (run.py, fleet.py, routing.py)."""
