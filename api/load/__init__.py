"""Replica load, pushed or scraped, kept with the answers and requests in flight since."""
