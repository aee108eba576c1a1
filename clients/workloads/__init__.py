"""The requests a router sees: traces, request logs, generated workloads, closed-loop chats."""
