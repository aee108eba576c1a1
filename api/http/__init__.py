"""The HTTP servers of the read path; importing them refuses httpx's command-line module."""

import sys

# httpx's command-line entry (rich, pygments) is no server's, and importing it is a tenth of
# a server's start: refused, httpx defines a stub ``main`` in its place.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
