"""kvindex.api.config.url_policy: link-local refused by default, an allow-list when given."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from kvindex.api.config import url_policy
from kvindex.api.config.url_policy import UntrustedUrlError, UrlPolicy


def check(policy: UrlPolicy, url: str) -> None:
    asyncio.run(policy.check(url))


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest",
        "http://[fe80::1]:8000",
        "https://169.254.0.1",
        "http://[::ffff:169.254.169.254]",
    ],
)
def test_link_local_addresses_are_refused_by_default(url: str) -> None:
    with pytest.raises(UntrustedUrlError, match="link-local"):
        check(UrlPolicy(), url)


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://127.0.0.1:8001", "http://[::1]"])
def test_other_addresses_are_allowed_by_default(url: str) -> None:
    check(UrlPolicy(), url)


def test_a_name_is_checked_by_what_it_resolves_to() -> None:
    check(UrlPolicy(), "http://localhost:8000")
    with pytest.raises(UntrustedUrlError, match=r"outside api\.replica_networks"):
        check(UrlPolicy.parse(("10.0.0.0/8",)), "http://localhost:8000")


def test_an_allow_list_admits_only_its_networks() -> None:
    policy = UrlPolicy.parse(("10.0.0.0/8", "169.254.10.0/24"))
    check(policy, "http://10.1.2.3:8000")
    check(policy, "http://169.254.10.9")  # listed, so allowed although link-local
    with pytest.raises(UntrustedUrlError, match=r"\['192.168.1.1'\]"):
        check(policy, "http://192.168.1.1")


def test_an_unresolvable_host_is_refused_only_under_an_allow_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def nowhere(host: str) -> None:
        return None

    monkeypatch.setattr(url_policy, "_resolve", nowhere)  # no DNS query leaves the machine
    unresolvable = "http://no-such-host.invalid:8000"
    check(UrlPolicy(), unresolvable)
    with pytest.raises(UntrustedUrlError, match="does not resolve"):
        check(UrlPolicy.parse(("10.0.0.0/8",)), unresolvable)


def test_parse_reads_cidrs() -> None:
    assert UrlPolicy.parse(("10.0.0.0/8",)).networks == (ipaddress.ip_network("10.0.0.0/8"),)
    with pytest.raises(ValueError, match="not-a-net"):
        UrlPolicy.parse(("not-a-net",))
