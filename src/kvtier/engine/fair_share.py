"""Fair share of the engine across tenants: a virtual token counter per tenant.

Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024), the Virtual Token
Counter: each tenant's counter adds up the tokens the engine has computed for it (prefill
chunks and decoded tokens alike); when the scheduler has room for more work, the tenant
with the smallest counter goes first. A tenant that floods the engine runs its counter up
and yields to the others; one alone gets the whole engine. A tenant that comes back after
having nothing in flight starts at the smallest counter of those that do, so it neither
banks credit while away nor owes for work done before. Only tenants with requests in
flight are kept.
"""

from __future__ import annotations


class FairShare:
    def __init__(self) -> None:
        self.served: dict[str | None, int] = {}  # tokens computed, per tenant in flight
        self.num_requests: dict[str | None, int] = {}  # in flight: waiting or running
        self.num_waiting: dict[str | None, int] = {}

    def added(self, tenant: str | None) -> None:
        """A request of `tenant` came in (it waits)."""
        if tenant not in self.num_requests:
            self.served[tenant] = min(self.served.values(), default=0)
            self.num_requests[tenant] = 0
        self.num_requests[tenant] += 1

    def finished(self, tenant: str | None) -> None:
        left = self.num_requests[tenant] - 1
        if left:
            self.num_requests[tenant] = left
        else:
            del self.num_requests[tenant], self.served[tenant]

    def queued(self, tenant: str | None) -> None:
        self.num_waiting[tenant] = self.num_waiting.get(tenant, 0) + 1

    def dequeued(self, tenant: str | None) -> None:
        left = self.num_waiting[tenant] - 1
        if left:
            self.num_waiting[tenant] = left
        else:
            del self.num_waiting[tenant]

    def charge(self, tenant: str | None, tokens: int) -> None:
        self.served[tenant] += tokens
