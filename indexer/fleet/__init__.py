"""The fleet: replica declarations, stream health, and their shared form in Redis."""
