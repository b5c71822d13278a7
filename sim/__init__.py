"""Offline simulator of KV-cache allocation (analysis, not serving).

Replays a request workload step by step through the paged block manager of
:mod:`pagedserve.scheduler` and through a contiguous (pre-PagedAttention) allocator with the
same memory, and reports utilisation, fragmentation and requests in flight. Modules:

* :mod:`.workload`: synthetic (ShareGPT-like) and JSONL workloads.
* :mod:`.contiguous`: the first-fit contiguous allocator (the baseline).
* :mod:`.backends`: paged and contiguous memory back ends behind one interface.
* :mod:`.simulator`: the step loop, :class:`~.simulator.SimConfig` and the reports.
* :mod:`.cli`: the ``pagedserve simulate`` command; :mod:`.plots`: its PNG figures.

Depends on :mod:`pagedserve.scheduler` only (no torch, no Ray, no gRPC).
"""
