"""The index's answer for one request: each candidate's streams and each replica's best match."""
