"""``kvindex proxy``: an OpenAI-compatible router that sends each request to the replica
kvindex picks, in one process with the read path (:mod:`kvindex.api.runtime`): settings,
auth, upstream choice, retry policy, forwarding and connections, metrics, app, service."""
