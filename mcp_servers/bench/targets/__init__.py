"""Benchmark targets behind one interface (:class:`~mcp_servers.bench.targets.base.BenchTarget`).

:mod:`~mcp_servers.bench.targets.twin` (virtual time), :mod:`~mcp_servers.bench.targets.http`
(the built-in HTTP runner) and :mod:`~mcp_servers.bench.targets.aiperf` (aiperf over HTTP).
"""
