"""``kvindex analyze``: what a request log could reuse, what breaks it, which policy fits."""
