"""The coordinator as plain Python: the allocator's owner behind calls, leases and a reply
cache (coordinator), its ordered line to the lanes (channel), the lanes' table, group and
recovery (supervisor), the steps in flight (inflight), a step built from the decisions
(step_build), request namespaces (namespaces), retries told from misuse (call_digest); the
lanes' collective backend is chosen by cpkv.core.backend. The Ray actor
(cpkv.actors.coordinator) only wraps it."""

from cpkv.coordinator.coordinator import Coordinator

__all__ = ["Coordinator"]
