"""Which replica URLs the API trusts with users' prompts (``/tokenize``) and its scrapes."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvindex.indexer.domain.errors import KvIndexError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class UntrustedUrlError(KvIndexError):
    """A replica URL whose host is, or resolves to, an address the policy refuses."""


@dataclass(frozen=True, slots=True)
class UrlPolicy:
    """The networks replica URLs may point into (empty: anything but link-local)."""

    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, networks: tuple[str, ...]) -> UrlPolicy:
        """From CIDR strings (``10.0.0.0/8``); ValueError names a bad one."""
        return cls(tuple(ipaddress.ip_network(n, strict=False) for n in networks))

    def allows(self, address: Address) -> bool:
        """Whether one address may be sent prompts (IPv4-mapped: as the IPv4 address)."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if self.networks:
            return any(address in network for network in self.networks)
        return not address.is_link_local

    async def check(self, url: str) -> None:
        """Raise :class:`UntrustedUrlError` unless every address of ``url``'s host is allowed."""
        host = urlsplit(url).hostname or ""
        addresses = await _resolve(host)
        if addresses is None:
            if self.networks:
                raise UntrustedUrlError(f"url: host {host!r} does not resolve")
            return
        refused = sorted(str(a) for a in addresses if not self.allows(a))
        if refused:
            rule = "outside api.replica_networks" if self.networks else "link-local"
            raise UntrustedUrlError(f"url: {url!r} resolves to {rule} addresses {refused}")


async def _resolve(host: str) -> set[Address] | None:
    """The addresses of a host (a literal IP is itself); None if it does not resolve."""
    try:
        return {ipaddress.ip_address(host.split("%", 1)[0])}
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}
