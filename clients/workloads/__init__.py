"""The requests a router sees: Mooncake traces, request logs, generated workloads and
closed-loop chats; one home for what ``kvindex simulate``, the demo and the benchmarks send."""
